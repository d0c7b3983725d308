"""The loopback fallback (no CAP_NET_ADMIN) opens nothing beyond loopback, and plait starts
no process through a shell.

torch binds a TCPStore server to every interface whatever host it is given, so on a
machine without namespaces a job's rendezvous store would be reachable from the network.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

from plait.cluster import Cluster, launch

SRC = Path(__file__).resolve().parents[2] / "src" / "plait"

LISTENERS = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()  # every store and gloo pair is up
    def inodes(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
        return out
    mine = inodes(os.getpid()) | inodes(os.getppid())  # this worker and its agent
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # LISTEN
                found.append(f[1].split(":")[0])
    with open(os.path.join(sys.argv[1], f"listen.{dist.get_rank()}"), "w") as f:
        json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian: 127.x.x.x has 7F in the last byte
        return hex_addr[-2:] == "7F"
    return hex_addr == "0" * 31 + "1" or hex_addr.upper() == "0000000000000000FFFF00000100007F"


def test_fallback_listens_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS)
    with Cluster(nodes=2, emulated=False) as c:  # the fallback, even when run as root
        res = launch(c, [str(script), str(tmp_path)], timeout_s=120, quiet=True)
    assert res.ok, res.tail()
    seen = [a for r in range(2) for a in json.loads((tmp_path / f"listen.{r}").read_text())]
    assert seen, "found no listening socket at all: the check itself is broken"
    assert all(_is_loopback(a) for a in seen), seen


def test_no_subprocess_goes_through_a_shell() -> None:
    bad = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in {
                "os.system",
                "os.popen",
                "subprocess.getoutput",
                "subprocess.getstatusoutput",
            }:
                bad.append(f"{path}:{node.lineno} {name}")
            for kw in node.keywords:
                if kw.arg == "shell" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    bad.append(f"{path}:{node.lineno} shell={ast.unparse(kw.value)}")
    assert not bad, bad
