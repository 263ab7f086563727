"""A probe of the test command's Redis server: is it ever silent, and whose fault is it?

``python tests/helpers/redis_probe.py watch URL LOG`` asks the server for its INFO four times a
second for as long as it runs and writes to LOG, as JSON lines with the wall time, every
silence (an answer that took more than ``SILENCE`` seconds, or failed) with what the server
did since its last answer (its CPU seconds and the commands it ran: a server that ran
commands all along was busy with other clients; one that got no CPU was not running), and
every time the probe itself woke more than ``SILENCE`` seconds late from its pause (then the
host starved every process, the probe included).
``python tests/helpers/redis_probe.py report URL LOG`` prints the silences and Redis's own
latency events (``LATENCY LATEST``: the server stalled inside a command, a fork or an
expiry, with ``latency-monitor-threshold`` set by the test command), so a silence reads as
the server's (a latency event then), its clients' (it ran commands all along), the host's
(it got no CPU, the probe woke late too) or the server's scheduling (no CPU, the probe on
time)."""

from __future__ import annotations

import json
import sys
import time

import redis

#: a ping slower than this many seconds is a silence
SILENCE = 1.0
PERIOD = 0.25


def watch(url: str, log: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=60, socket_connect_timeout=10)
    woke_by = time.monotonic()
    last: dict = {}
    while True:
        wall, began = time.time(), time.monotonic()
        late = began - woke_by
        if late > SILENCE:
            with open(log, "a") as f:
                f.write(json.dumps({"wall": round(wall, 3), "probe_late": round(late, 3)}) + "\n")
        error = ""
        try:
            info = client.info()
        except redis.RedisError as e:
            error, info = f"{type(e).__name__}: {e}", {}
        took = time.monotonic() - began
        if (took > SILENCE or error) and last:
            line = {"wall": round(wall, 3), "took": round(took, 3), "error": error}
            if info:  # what the server did since the last answer: busy, or not running at all
                line["server_cpu_s"] = round(_cpu(info) - _cpu(last), 3)
                line["commands"] = (
                    info["total_commands_processed"] - last["total_commands_processed"]
                )
                line["clients"] = info["connected_clients"]
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")
        last = info or last
        if error:
            time.sleep(1.0)  # sync-ok: the server is gone or restarting, ask again later
        woke_by = time.monotonic() + PERIOD
        time.sleep(PERIOD)  # sync-ok: the probe's period


def _cpu(info: dict) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def report(url: str, log: str) -> None:
    try:
        with open(log) as f:
            silences = [json.loads(line) for line in f if line.strip()]
    except OSError:
        silences = []
    pings = [s for s in silences if "took" in s]
    late = [s for s in silences if "probe_late" in s]
    longest = sorted(pings, key=lambda s: -s["took"])[:5]
    print(f"redis probe: {len(pings)} answers slower than {SILENCE:.0f} s; the longest: {longest}")
    starved = sorted(late, key=lambda s: -s["probe_late"])[:5]
    print(f"redis probe: {len(late)} times the probe itself woke late (the host): {starved}")
    try:
        events = redis.Redis.from_url(url, socket_timeout=5).execute_command("LATENCY", "LATEST")
    except redis.RedisError as e:
        events = f"(not read: {e})"
    print(f"redis probe: the server's own latency events (name, when, last ms, max ms): {events}")


if __name__ == "__main__":
    {"watch": watch, "report": report}[sys.argv[1]](sys.argv[2], sys.argv[3])
