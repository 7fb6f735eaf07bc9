"""7. Redis, as the article compared it: a reliable LMOVE queue and Streams, one job at a time.

    LMOVE:   LMOVE jobs processing:<w> RIGHT LEFT -> (work) -> LREM processing:<w> 1 <job>
    Streams: XREADGROUP GROUP g <w> COUNT 1 STREAMS jobs > -> (work) -> XACK jobs g <id>

4 worker processes (redis-py, one connection each), zero-work jobs pre-loaded, released
together; the run ends when every worker finds the queue empty. Uses the Redis at
$ASYNCJOBQ_REDIS_URL (default redis://127.0.0.1:6379/0); if none answers, starts
`redis-server --save '' --appendonly no` on port 6390 for the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from .common import log, release, spawn

KEY = "asyncjobq-bench"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisServer:
    def __init__(self) -> None:
        import redis

        self.url = os.environ.get("ASYNCJOBQ_REDIS_URL", DEFAULT_URL)
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            redis.Redis.from_url(self.url).ping()
        except redis.ConnectionError:
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("no Redis answers and redis-server is not installed") from None
            self.url = "redis://127.0.0.1:6390/0"
            log("no Redis answered; starting redis-server --save '' --appendonly no on 6390")
            self.proc = subprocess.Popen([exe, "--port", "6390", "--save", "", "--appendonly",
                                          "no"], stdout=subprocess.DEVNULL)
            for _ in range(50):
                try:
                    redis.Redis.from_url(self.url).ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
        info = redis.Redis.from_url(self.url).info()
        self.version = str(info.get("redis_version"))
        self.persistence = (f"aof={info.get('aof_enabled')} "
                            f"rdb_changes_since_save={info.get('rdb_changes_since_last_save')}")

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def _load(r: Any, mode: str, jobs: int) -> None:
    r.delete(KEY, *[f"{KEY}:processing:{i}" for i in range(64)])
    pipe = r.pipeline(transaction=False)
    for i in range(jobs):
        body = json.dumps({"id": i})
        if mode == "lmove":
            pipe.lpush(KEY, body)
        else:
            pipe.xadd(KEY, {"body": body})
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    if mode == "streams":
        r.xgroup_create(KEY, "g", id="0")


def worker(url: str, mode: str, name: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    r.ping()
    print("ready", flush=True)
    sys.stdin.readline()
    n = 0
    if mode == "lmove":
        processing = f"{KEY}:processing:{name}"
        while True:
            job = r.lmove(KEY, processing, "RIGHT", "LEFT")
            if job is None:
                break
            json.loads(job)
            r.lrem(processing, 1, job)
            n += 1
    else:
        while True:
            got = r.xreadgroup("g", name, {KEY: ">"}, count=1)
            if not got or not got[0][1]:
                break
            for msg_id, fields in got[0][1]:
                json.loads(fields[b"body"])
                r.xack(KEY, "g", msg_id)
                n += 1
    print(n, flush=True)


def cell(server: RedisServer, mode: str, workers: int, jobs: int) -> dict[str, Any]:
    r = server.client()
    _load(r, mode, jobs)
    procs = [spawn("redis_cmp", server.url, mode, str(i)) for i in range(workers)]
    t0 = release(procs)
    counts = []
    for p in procs:
        assert p.stdout is not None
        counts.append(int(p.stdout.readline()))
        p.wait(60)
    elapsed = time.monotonic() - t0
    r.delete(KEY)
    return {"jobs_per_s": sum(counts) / elapsed, "done": sum(counts), "elapsed_s": elapsed}


def cells(server: RedisServer, workers: int, jobs: int) -> list[tuple[str, Any]]:
    return [(f"redis {m} w={workers}", lambda m=m: cell(server, m, workers, jobs))
            for m in ("lmove", "streams")]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3])
