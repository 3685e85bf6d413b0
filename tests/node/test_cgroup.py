"""The memory-cgroup reader the node tests measure the sidecar with (conftest.memory_charged),
on fake cgroup trees: this node runs cgroup v1, most current nodes (and CI runners) cgroup v2,
and both paths must read the container's own charge, not a parent's or another controller's."""
from conftest import memory_charged

POD = "/kubepods/besteffort/pod1234/c0ffee"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_reads_memory_current_of_the_unified_group(tmp_path):
    write(tmp_path / POD.lstrip("/") / "memory.current", "4812800\n")
    # A parent's charge includes every sibling: it must not be what is read.
    write(tmp_path / "kubepods/besteffort/pod1234/memory.current", "99999999\n")
    assert memory_charged(f"0::{POD}\n", root=str(tmp_path)) == 4812800


def test_cgroup_v1_reads_usage_in_bytes_of_the_memory_hierarchy(tmp_path):
    write(tmp_path / "memory" / POD.lstrip("/") / "memory.usage_in_bytes", "3047424\n")
    # Hybrid hosts also list the unified group; the memory controller's line wins.
    write(tmp_path / POD.lstrip("/") / "memory.current", "1\n")
    proc = (f"12:pids:{POD}\n11:cpu,cpuacct:{POD}\n5:memory:{POD}\n"
            f"1:name=systemd:{POD}\n0::{POD}\n")
    assert memory_charged(proc, root=str(tmp_path)) == 3047424


def test_cgroup_v1_finds_memory_among_joined_controllers(tmp_path):
    write(tmp_path / "memory" / POD.lstrip("/") / "memory.usage_in_bytes", "2048\n")
    assert memory_charged(f"7:memory,hugetlb:{POD}\n", root=str(tmp_path)) == 2048
