// Stream-ordered transfers: the two kernels a CUDA stream runs around a put (or a publish).
//
// Every stream-ordered operation owns a slot: a sequence counter and three 64-bit words, all in
// host-mapped (pinned) memory; the host's proxy thread watches the words:
//
//   bell    the sequence number of the newest request     (written here, read by the proxy)
//   done    the newest sequence number that has completed (written by the proxy)
//   failed  the newest sequence number that failed        (written by the proxy)
//
// transport_ring runs where the put stands on its stream, so only after every earlier kernel of
// the stream has finished: it takes the next sequence number and rings the bell. The proxy posts
// the prepared transfer, which reads the source as it is then, and writes done (and failed on an
// error) when it ends. transport_wait holds a stream until done reaches the sequence number of
// the newest ring; it gives up after a timeout and raises its own flag, so a stream never hangs.
// The counter is memory the ring kernel increments, so a captured graph takes a new sequence
// number at every replay with the same kernel arguments. It is host memory that the CPU zeroes:
// a device counter made by the first stream-ordered call inside a capture would have its
// zero-fill captured too, and every replay would ring the same number.
//
// Compiled at run time with NVRTC (CuPy); `nvcc --ptx` compiles this file as a check.

extern "C" {

__device__ __forceinline__ unsigned long long transport_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread. counter and bell: host-mapped.
__global__ void transport_ring(unsigned long long* counter, volatile unsigned long long* bell) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long seq = *counter + 1;
    *counter = seq;
    __threadfence_system();  // the counter before the bell, and both before the host reads
    *bell = seq;
    __threadfence_system();
}

// One thread. Waits until done >= the newest sequence number rung on this slot. On timeout it
// sets timed_out to that number (host-mapped), so the host raises at its next check.
__global__ void transport_wait(const unsigned long long* counter,
                               volatile unsigned long long* done,
                               volatile unsigned long long* timed_out,
                               unsigned long long timeout_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long seq = *((volatile const unsigned long long*)counter);
    unsigned long long start = transport_now_ns();
    while (*done < seq) {
        if (transport_now_ns() - start > timeout_ns) {
            *timed_out = seq;
            __threadfence_system();
            return;
        }
#if __CUDA_ARCH__ >= 700
        __nanosleep(2000);
#endif
    }
    __threadfence_system();  // what the transfer wrote (a get) is visible to later kernels
}

}  // extern "C"
