# Throwaway probe (see NOTES.md): read_state beside a Python-busy thread. PYTHONPATH=. python gil_probe.py
import os, time, tempfile, threading, numpy as np, torch
from streaming import parked_file as pf
flat = torch.randint(0, 255, (2156000,), dtype=torch.uint8)
loose = {f"codec.{i}": torch.randn(1, 64, 40) for i in range(14)} | {"codec.h": torch.randn(1,1,256), "codec.c": torch.randn(1,1,256)}
d = tempfile.mkdtemp(dir="/tmp/disk_helper")
info = pf.write_state(f"{d}/a.park", flat, loose, "fp")
path = f"{d}/a.park"
running = True
def engine():
    a = torch.zeros(8)
    while running:
        s = 0
        for i in range(300): s += i * i
        torch.add(a, 1, out=a)
t = threading.Thread(target=engine); t.start()
def fromfile():
    arr = np.fromfile(path, dtype=np.uint8)
    buf = torch.from_numpy(arr)
    assert len(arr) == info.size
    return pf._checksum([arr[len(info.head):].view(np.uint64)])
def only_io():
    buffer = torch.empty(info.size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        os.fstat(f.fileno()); f.readinto(memoryview(buffer.numpy()))
def sums():
    return pf._checksum([flat.numpy().view(np.uint64)])
for label, fn in (("read_state", lambda: pf.read_state(path, info)), ("np.fromfile+checksum", fromfile), ("io only", only_io), ("checksum only", sums), ("torch.empty only", lambda: torch.empty(info.size, dtype=torch.uint8))):
    xs = []
    for i in range(300):
        s = time.perf_counter(); fn(); xs.append((time.perf_counter() - s) * 1000)
    print(f"{label:22s} wall p50 {np.percentile(xs,50):.2f} p90 {np.percentile(xs,90):.2f} p99 {np.percentile(xs,99):.2f}")
running = False; t.join()
