"""The admin token file: who may own it, who may read it, and the Kubernetes Secret mount.

The checks run as the users they are about: the tests run as root and start children under other
uids (forked, then setuid), as a pod's ``runAsUser``/``fsGroup`` would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from conftest import REPO
from router.admin import TokenFileError, read_token

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other uids needs root")
OTHER_UID = 65534  # nobody

@pytest.fixture
def shared_dir():
    """A temp dir other uids can traverse (pytest's tmp_path is 0700), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="fo-token-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def token_file(d: Path, uid: int, gid: int, mode: int, text: str = "s3cret\n") -> Path:
    path = d / "token"
    path.unlink(missing_ok=True)
    path.write_text(text)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


def read_as(path: Path, uid: int, gid: int, groups: list[int]) -> str:
    """read_token's verdict in a forked child that dropped to ``uid``/``gid``/``groups`` (a forked
    child, not a new interpreter: this Python's binary may live where other uids cannot exec it)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only reads
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                verdict = "ok " + read_token(path).decode()
            except TokenFileError as e:
                verdict = f"refused {e}"
            os.write(w, verdict.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed to drop privileges or to read"
    return out


@as_root
def test_a_token_file_owned_by_another_user_is_refused(shared_dir):
    # the red team's repro: a 0600 file of another uid was accepted, and that user's token worked
    path = token_file(shared_dir, OTHER_UID, OTHER_UID, 0o600)
    with pytest.raises(TokenFileError, match=f"owned by uid {OTHER_UID}.*chown"):
        read_token(path)
    # ... and so a router refuses to start on it, saying why
    res = subprocess.run([sys.executable, "-m", "failover", "router", "--port", "0", "--backend",
                          "a=http://127.0.0.1:9", "--admin-token-file", str(path)],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert res.returncode != 0 and f"owned by uid {OTHER_UID}" in res.stderr


@as_root
def test_group_read_is_accepted_only_as_a_root_owned_secret_of_our_group(shared_dir):
    me = os.geteuid()
    path = token_file(shared_dir, me, os.getegid(), 0o640)
    if me != 0:  # our own file, group-readable: another member of the group could read it
        with pytest.raises(TokenFileError, match="chmod 600"):
            read_token(path)
    path = token_file(shared_dir, 0, 12345, 0o440)  # root-owned, but a group we are not in
    assert read_as(path, 1000, 1000, [1000]).startswith("refused")
    path = token_file(shared_dir, 0, 1000, 0o460)  # group-writable: never
    assert "open to group 1000" in read_as(path, 1000, 1000, [1000])
    path = token_file(shared_dir, 0, 1000, 0o444)
    assert "readable by others" in read_as(path, 1000, 1000, [1000])


@as_root
def test_the_pod_reads_the_secret_as_the_manifest_mounts_it(shared_dir):
    """node.yaml's Secret volume and securityContext, applied by hand: root-owned, group fsGroup,
    defaultMode; the process runs as runAsUser/runAsGroup with fsGroup as a supplementary group."""
    import yaml

    deployment = next(d for d in yaml.safe_load_all((REPO / "deploy/k8s/node.yaml").read_text())
                      if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    ctx = pod["securityContext"]
    secret = next(v["secret"] for v in pod["volumes"] if "secret" in v)
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "token")
    config = next(d for d in yaml.safe_load_all((REPO / "deploy/k8s/node.yaml").read_text())
                  if d["kind"] == "ConfigMap")["data"]["node.toml"]
    assert f'admin_token_file = "{mount["mountPath"]}/token"' in config
    uid, gid, fs_group = ctx["runAsUser"], ctx["runAsGroup"], ctx.get("fsGroup")
    assert fs_group is not None, "without fsGroup the root-owned Secret is unreadable by the pod's uid"
    path = token_file(shared_dir, 0, fs_group, secret["defaultMode"])
    assert read_as(path, uid, gid, [fs_group]) == "ok s3cret"
    # the manifest as it was (defaultMode 0400, no fsGroup): the pod could not read its token
    path = token_file(shared_dir, 0, 0, 0o400)
    assert "cannot read token file" in read_as(path, uid, gid, [])


@as_root
def test_the_daemon_init_container_leaves_the_run_dir_to_the_serving_uid(shared_dir):
    """cache-daemon.yaml's init container, run as it is written (as root) on a root-owned 0755 dir,
    as kubelet creates a DirectoryOrCreate hostPath."""
    import yaml

    ds = yaml.safe_load((REPO / "deploy/k8s/cache-daemon.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0 and init["securityContext"]["runAsNonRoot"] is False
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    host = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "run")
    run_dir = shared_dir / "run"
    run_dir.mkdir(mode=0o755)
    os.chown(run_dir, 0, 0)
    cmd = [part.replace(host, str(run_dir)) for part in init["command"]]
    subprocess.run(cmd, check=True, timeout=30)
    st = run_dir.stat()
    ctx = pod["securityContext"]
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (ctx["runAsUser"], ctx["runAsGroup"], 0o700)
    # the node pods run as the same uid: the daemon accepts their peers (SO_PEERCRED)
    node = next(d for d in yaml.safe_load_all((REPO / "deploy/k8s/node.yaml").read_text())
                if d["kind"] == "Deployment")
    assert node["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == ctx["runAsUser"]
