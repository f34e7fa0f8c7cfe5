import json, time, signal
import pytest
from harness import worker_args, alive
from store_attack import Attacker, Cluster, wait_for

@pytest.fixture
def cluster(daemon_factory, shared_tmp):
    return Cluster(daemon_factory, shared_tmp, prefix="xpl", firewall=False)

def snap(cluster, job):
    out = []
    for d in cluster:
        try:
            doc = d.ctl("status", job)
            out.append((d.name, doc["state"], doc.get("held"), [(p["node"], p["state"]) for p in doc["nodes"]], [(w["rank"], w["state"], w["pid"]) for w in doc["workers"]]))
        except Exception as e:
            out.append((d.name, "ERR", str(e)[:200]))
    return out

@pytest.mark.parametrize("how", ["term", "kill"])
@pytest.mark.parametrize("what", ["all", "outcome", "rdzv", "spec", "parts"])
def test_explore(cluster, shared_tmp, how, what):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    att = Attacker(cluster)
    a = n1.submit_wait("--nnodes", "2", *worker_args())
    assert a["state"] == "SUCCEEDED"
    A = a["id"]
    b = n1.submit("--nnodes", "2", *worker_args("--sleep", "0"))["id"]
    n1.wait_running(b, 2, timeout=60)
    keys = []
    if what in ("all", "spec"): keys.append(("jobs/spec/%s", None))
    if what in ("all", "outcome"): keys.append(("jobs/outcome/%s", None))
    if what in ("all", "parts"):
        keys += [("jobs/parts/%s", None)] + [(f"jobs/part/%s/{d.name}", None) for d in cluster]
    if what in ("all", "rdzv"): keys.append(("rdzv/%s/state", None))
    for k, _ in keys:
        v = att.read(k % A)
        assert v is not None, k
        att.write(k % b, v)
    print("copied", [k for k, _ in keys])
    print("before restart", snap(cluster, b))
    if how == "term":
        n2.stop()
    else:
        n2.proc.kill(); n2.proc.wait()
    n2.start(wait=True, timeout=60)
    for t in range(8):
        time.sleep(3)
        print(f"t+{3*(t+1)}s", snap(cluster, b))
    print(n2.log_text()[-3000:])
    print(n1.log_text()[-3000:])
    assert False
