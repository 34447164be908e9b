"""Metrics of an Nsight Compute report (.ncu-rep) read without Nsight Compute, for a machine that has none.

A report is ``NVR\\0``, a 4-byte header length, the header, then length-prefixed (uint32 LE) protobuf messages. Each
profiled launch is one message holding repeated metric results (field 13: a metric-name index and a value message
whose double is field 3, integer field 5, string field 1); the names are indices into the string table of the
latest message that carries one (field 4: repeated strings under field 1). Decoded by the wire format alone (no
schema); checked against the ncu 2025.3 report of session 32 (launch__grid_size, registers and gpu__time_duration
read as the run's launches had them).

    python benchmarks/kernels/ncu_report_metrics.py report.ncu-rep --out metrics.json \\
        --show gpu__time_duration.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
"""

from __future__ import annotations

import argparse
import json
import struct

MAGIC = b"NVR\x00"


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def fields(buf: bytes) -> list[tuple[int, int, object]] | None:
    """(field, wire type, value) of a protobuf message, or None when ``buf`` does not parse as one."""
    out, i = [], 0
    try:
        while i < len(buf):
            key, i = _varint(buf, i)
            field, wire = key >> 3, key & 7
            if field == 0:
                return None
            if wire == 0:
                value, i = _varint(buf, i)
            elif wire == 1:
                value, i = struct.unpack("<d", buf[i:i + 8])[0], i + 8
            elif wire == 5:
                value, i = struct.unpack("<f", buf[i:i + 4])[0], i + 4
            elif wire == 2:
                size, i = _varint(buf, i)
                value, i = buf[i:i + size], i + size
                if i > len(buf):
                    return None
            else:
                return None
            out.append((field, wire, value))
    except (IndexError, struct.error):
        return None
    return out


def messages(data: bytes) -> list[bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not an Nsight Compute report (no NVR magic)")
    header = struct.unpack("<I", data[4:8])[0]
    pos, out = 8 + header, []
    while pos + 4 <= len(data):
        size = struct.unpack("<I", data[pos:pos + 4])[0]
        out.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    return out


def _string_table(message: list) -> list[str] | None:
    for field, wire, value in message:
        if wire == 2 and field == 4 and len(value) > 1000:
            inner = fields(value)
            names = [v for f, w, v in inner or [] if f == 1 and w == 2]
            if names and all(n[:1].isascii() and n[:1].isalpha() for n in names[:20]):
                return [n.decode(errors="replace") for n in names]
    return None


def _value(buf: bytes):
    for field, wire, value in fields(buf) or []:
        if field == 3 and wire == 1:
            return value
        if field in (4, 5) and wire == 0:
            return value
        if field == 1 and wire == 2:
            return value.decode(errors="replace")
    return None


def launches(path: str) -> list[dict]:
    """One dict of metric name -> value per profiled launch, in launch order."""
    with open(path, "rb") as f:
        data = f.read()
    table, out = None, []
    for raw in messages(data):
        message = fields(raw)
        if message is None:
            continue
        if any(field == 13 for field, _, _ in message):
            metrics = {}
            for field, _, value in message:
                if field != 13:
                    continue
                index = payload = None
                for f, w, v in fields(value) or []:
                    if f == 1 and w == 0:
                        index = v
                    elif f == 2 and w == 2:
                        payload = v
                if table is not None and index is not None and index < len(table) and payload is not None:
                    metrics[table[index]] = _value(payload)
            out.append(metrics)
        else:
            table = _string_table(message) or table
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--out", help="write every launch's metrics as JSON")
    parser.add_argument("--show", nargs="*", default=[], help="metrics to print, one row each")
    args = parser.parse_args()
    found = launches(args.report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    print(f"{len(found)} launches, {len(found[0]) if found else 0} metrics each")
    for name in args.show:
        print(f"{name:<78}", [round(m[name], 3) if isinstance(m.get(name), float) else m.get(name) for m in found])


if __name__ == "__main__":
    main()
