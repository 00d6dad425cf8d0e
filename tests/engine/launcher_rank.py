"""A stand-in rank for test_parent_watch.py: watches its launcher, and on SIGTERM records it and exits (as the
trainer saves and exits). Writes its PID and launcher chain to ARGV[1] once watching."""
import json
import os
import signal
import sys
import time

from vqlcmd.engine.parent_watch import watch_launcher

out = next(a for a in sys.argv[1:] if not a.startswith("--"))  # (the launcher adds --local_rank=0 first)
ignore_term = "--ignore-term" in sys.argv


def on_term(signum, frame):
    with open(out + ".term", "a") as f:
        f.write(f"{os.getpid()}\n")
    if not ignore_term:  # else: a rank stuck where Python's handler cannot end it
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
watch = watch_launcher(log=lambda m: open(out + ".log", "a").write(m + "\n"), interval=0.2, grace=2.0)
chain = [[p.pid, p.command] for p in watch.chain] if watch else []
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "chain": chain}, f)
os.replace(out + ".tmp", out)
for _ in range(600):
    time.sleep(0.1)
