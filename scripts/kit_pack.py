"""What scripts/kit.sh's two kits (device, FlashInfer) share in Python: whether a built kit is up to date, a
reproducible .tar.gz, and the kit.json that lists every file of a kit and holds it to its size limit.

    python3 scripts/kit_pack.py up-to-date KIT KEY   exit 0 when KIT/kit.json has KEY and every file it lists is
                                                    there with its sha256, else 1
The build steps of kit.sh import `write_archive` and `write_manifest` (scripts/ on sys.path)."""

import gzip
import hashlib
import io
import json
import pathlib
import sys
import tarfile


def up_to_date(kit: pathlib.Path, key: str) -> bool:
    manifest = kit / "kit.json"
    if not manifest.is_file():
        return False
    m = json.loads(manifest.read_text())
    return m.get("key") == key and all(
        (kit / f["path"]).is_file() and hashlib.sha256((kit / f["path"]).read_bytes()).hexdigest() == f["sha256"]
        for f in m["files"])


def write_archive(out: pathlib.Path, entries) -> None:
    """entries: (name, bytes) in the order they are stored. Same entries, same bytes: fixed times, owners and
    modes, gzip without a timestamp."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
            tar.addfile(ti, io.BytesIO(data))
    with open(out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())


def write_manifest(kit: pathlib.Path, key: str, limit_mib: int, fields: dict, tag: str) -> None:
    """kit/kit.json: the key, the limit, the total, `fields`, then the path, size and sha256 of every file; exits
    naming the kit (`tag`) when the files exceed limit_mib."""
    files = [{"path": str(p.relative_to(kit)), "bytes": p.stat().st_size,
              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in sorted(kit.rglob("*")) if p.is_file()]
    total = sum(f["bytes"] for f in files)
    manifest = {"key": key, "limit_mib": int(limit_mib), "total_bytes": total, **fields, "files": files}
    (kit / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if total > int(limit_mib) * 2**20:
        sys.exit(f"[{tag}] ERROR: the kit is {total / 2**20:.1f} MiB, over its {limit_mib} MiB")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "up-to-date":
        sys.exit(__doc__)
    sys.exit(0 if up_to_date(pathlib.Path(sys.argv[2]), sys.argv[3]) else 1)
