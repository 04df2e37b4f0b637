"""Regenerates the pickle fixtures used by tests/pickle_reader.rs (run from this directory)."""
import pickle

shared = [7, 8]
plain = {
    "ints": [0, 1, -1, 255, 256, 65535, 65536, -2**31, 2**31 - 1, 2**31, 2**47 + 5,
             2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**100],
    "f": 1.5,
    "neg_f": -0.25,
    "s": "h\u00e9llo \u20ac",
    "long_s": "x" * 300,
    "t0": (),
    "t1": (1,),
    "t2": (1, 2),
    "t3": (1, 2, 3),
    "t4": (1, 2, 3, 4),
    "n": None,
    "T": True,
    "F": False,
    "a": shared,
    "b": shared,
    "nested": {"k": [{"x": 1}, [2, [3]]]},
    "many": list(range(1500)),
}
for proto in range(0, 6):
    with open(f"plain_p{proto}.pickle", "wb") as f:
        pickle.dump(plain, f, protocol=proto)

# Small files for the every-prefix truncation test.
small = {k: v for k, v in plain.items() if k not in ("many", "long_s")}
for proto in (0, 2, 4):
    with open(f"small_p{proto}.pickle", "wb") as f:
        pickle.dump(small, f, protocol=proto)

extended = {
    "bytes": b"\x00\x01\xff",
    "big_bytes": bytes(range(256)) * 2,
    "set": {3},
    "fs": frozenset({4}),
    "ba": bytearray(b"z"),
}
with open("extended_p5.pickle", "wb") as f:
    pickle.dump(extended, f, protocol=5)

# 100 KB of data so that protocol 4 uses several frames.
with open("framed_p4.pickle", "wb") as f:
    pickle.dump(["y" * 1000 + str(i) for i in range(100)], f, protocol=4)

with open("old_list_of_segments.pickle", "wb") as f:
    pickle.dump([{"device": 0, "address": 4096, "total_size": 2097152,
                  "blocks": [{"size": 2097152, "state": "inactive"}]}], f, protocol=4)

def snapshot_with(addr, size):
    return {"segments": [], "device_traces": [[{"action": "alloc", "addr": addr, "size": size,
                                                "stream": 0, "frames": []}]]}

with open("addr_2_63.pickle", "wb") as f:
    pickle.dump(snapshot_with(2**63 + 5, 512), f, protocol=4)
with open("size_2_64.pickle", "wb") as f:
    pickle.dump(snapshot_with(4096, 2**64), f, protocol=4)
