"""Run by ``transport bench`` with UCX_PROTO_INFO=y: one put and one get between two NIXL agents
of this process, so that UCX prints the protocols and transports it picks on this host."""

from __future__ import annotations

import torch

from transport.cli.bench import _raw


def main() -> None:
    a, b = _raw.new_agent("bench-probe-a"), _raw.new_agent("bench-probe-b")
    x = torch.ones(1 << 20, dtype=torch.uint8)
    y = torch.zeros(1 << 20, dtype=torch.uint8)
    a.register_memory(x)
    b.register_memory(y)
    name = _raw.remote_name(a.add_remote_agent(b.get_agent_metadata()))
    for op in ("WRITE", "READ"):
        path = _raw.RawPath(
            a, op, [(name, _raw.descs([x]), _raw.remote_descs([y.data_ptr()], [y.nbytes]))]
        )
        h = path.handles[0]
        st = a.transfer(h)
        while st == "PROC":
            b.get_new_notifs()
            st = a.check_xfer_state(h)
        path.close()


if __name__ == "__main__":
    main()
