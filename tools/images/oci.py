#!/usr/bin/env python3
"""Write a single-layer OCI image archive without a container daemon.

The archive is an OCI image layout in a tar (oci-layout, index.json, blobs/sha256/...), which
`ctr images import` and `skopeo copy oci-archive:...` accept. Every byte is a function of the
inputs: tar entries are sorted, owned by 0:0, stamped with --created, and gzip carries no
timestamp, so building twice from the same commit gives the same image digest.

    oci.py --name REF --out FILE --created EPOCH [--file SRC:DST[:MODE]] [--ldd BIN] ...

Prints the image (manifest) digest on stdout.
"""
import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

PASSWD = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = "root:x:0:\nnonroot:x:65532:\n"


class Layer:
    """Files of the image root, keyed by absolute path inside the image."""

    def __init__(self, mtime):
        self.mtime = mtime
        self.entries = {}  # path -> (kind, data_or_target, mode)

    def add_dir(self, path, mode=0o755):
        path = "/" + path.strip("/")
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            p = "/" + "/".join(parts[:i])
            if p not in self.entries:
                self.entries[p] = ("dir", None, mode if i == len(parts) else 0o755)

    def add_bytes(self, path, data, mode=0o644):
        self.add_dir(os.path.dirname(path))
        self.entries[path] = ("file", data, mode)

    def add_file(self, src, dst, mode=None):
        with open(src, "rb") as f:
            data = f.read()
        if mode is None:
            mode = 0o755 if os.access(src, os.X_OK) else 0o644
        self.add_bytes(dst, data, mode)

    def add_symlink(self, path, target):
        self.add_dir(os.path.dirname(path))
        self.entries[path] = ("symlink", target, 0o777)

    def add_ldd(self, binary):
        """The shared libraries `binary` loads (as ldd resolves them here), at the paths its
        loader looks for them."""
        out = subprocess.run(["ldd", binary], capture_output=True, text=True)
        if out.returncode != 0:
            if "not a dynamic executable" in out.stdout + out.stderr:
                return
            sys.exit(f"oci.py: ldd {binary}: {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            line = line.strip()
            if "=>" in line:
                path = line.split("=>", 1)[1].split("(")[0].strip()
            else:
                path = line.split("(")[0].strip()
            if path.startswith("/") and os.path.exists(path):
                self.add_file(os.path.realpath(path), path, 0o755)

    def tar(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for path in sorted(self.entries):
                kind, data, mode = self.entries[path]
                ti = tarfile.TarInfo(path.lstrip("/"))
                ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = self.mtime, mode, 0, 0, "", ""
                if kind == "dir":
                    ti.type = tarfile.DIRTYPE
                    tf.addfile(ti)
                elif kind == "symlink":
                    ti.type, ti.linkname = tarfile.SYMTYPE, data
                    tf.addfile(ti)
                else:
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        return buf.getvalue()


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="image reference, e.g. ghcr.io/o/app:1.0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--created", type=int, required=True, help="UNIX time stamped on every entry")
    ap.add_argument("--file", action="append", default=[], help="SRC:DST[:OCTAL_MODE]")
    ap.add_argument("--symlink", action="append", default=[], help="PATH:TARGET")
    ap.add_argument("--dir", action="append", default=[], help="PATH[:OCTAL_MODE]")
    ap.add_argument("--ldd", action="append", default=[], help="add the shared libraries of this file")
    ap.add_argument("--passwd", action="store_true", help="add /etc/passwd and /etc/group (root, nonroot 65532)")
    ap.add_argument("--user")
    ap.add_argument("--entrypoint", help="JSON list")
    ap.add_argument("--cmd", help="JSON list")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--expose", action="append", default=[], help="PORT/PROTO")
    ap.add_argument("--label", action="append", default=[], help="KEY=VALUE")
    ap.add_argument("--workdir")
    a = ap.parse_args()

    layer = Layer(a.created)
    for spec in a.dir:
        path, _, mode = spec.partition(":")
        layer.add_dir(path, int(mode, 8) if mode else 0o755)
    for spec in a.file:
        parts = spec.split(":")
        layer.add_file(parts[0], parts[1], int(parts[2], 8) if len(parts) > 2 else None)
    for spec in a.symlink:
        path, target = spec.split(":", 1)
        layer.add_symlink(path, target)
    for b in a.ldd:
        layer.add_ldd(b)
    if a.passwd:
        layer.add_bytes("/etc/passwd", PASSWD.encode())
        layer.add_bytes("/etc/group", GROUP.encode())

    raw = layer.tar()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=6) as g:
        g.write(raw)
    layer_gz = gz.getvalue()

    created = datetime.datetime.fromtimestamp(a.created, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = dict(kv.split("=", 1) for kv in a.label)
    cfg = {}
    if a.user:
        cfg["User"] = a.user
    if a.entrypoint:
        cfg["Entrypoint"] = json.loads(a.entrypoint)
    if a.cmd:
        cfg["Cmd"] = json.loads(a.cmd)
    cfg["Env"] = a.env or ["PATH=/usr/local/bin:/usr/bin:/bin"]
    if a.expose:
        cfg["ExposedPorts"] = {p: {} for p in sorted(a.expose)}
    if labels:
        cfg["Labels"] = labels
    if a.workdir:
        cfg["WorkingDir"] = a.workdir
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": created, "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [sha(raw)]},
        "history": [{"created": created, "created_by": "tools/images/build.sh"}],
    }, sort_keys=True, separators=(",", ":")).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(layer_gz), "size": len(layer_gz)}],
        "annotations": {k: v for k, v in labels.items() if k.startswith("org.opencontainers.")},
    }, sort_keys=True, separators=(",", ":")).encode()
    tag = a.name.rsplit(":", 1)[1] if ":" in a.name.rsplit("/", 1)[-1] else "latest"
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
                       "size": len(manifest), "annotations": {"io.containerd.image.name": a.name,
                                                              "org.opencontainers.image.ref.name": tag}}],
    }, sort_keys=True, separators=(",", ":")).encode()

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def put(name, data, kind=tarfile.REGTYPE):
            ti = tarfile.TarInfo(name)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.type = a.created, 0, 0, "", "", kind
            if kind == tarfile.DIRTYPE:
                ti.mode = 0o755
                tf.addfile(ti)
            else:
                ti.mode, ti.size = 0o644, len(data)
                tf.addfile(ti, io.BytesIO(data))
        put("blobs", None, tarfile.DIRTYPE)
        put("blobs/sha256", None, tarfile.DIRTYPE)
        for blob in sorted([config, manifest, layer_gz], key=sha):
            put("blobs/sha256/" + sha(blob).split(":")[1], blob)
        put("index.json", index)
        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    tmp = a.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out.getvalue())
    os.replace(tmp, a.out)
    print(sha(manifest))


if __name__ == "__main__":
    main()
