"""A TLS cluster on an encrypted node network: nothing of a training run crosses the cables in clear.

Ray's TLS (test_tls.py) covers Ray's gRPC, not torch.distributed's gloo connections, which carry
the parameters and gradients in clear (test_tls finds the marked weights on the wire). Here every
node reaches every other through WireGuard (tests/cluster/wireguard.py: the node addresses, and
so Ray's and gloo's connections, are on the tunnel), and a 2-worker run across the nodes, with
cluster.tls and the same marked model, leaves on the switch only WireGuard's UDP between the
cables: no TCP, no run name, no token, no marked weights. Two controls show the capture could
have failed: a plaintext marker sent to w1's cable address is found, the same marker's twin sent
to w1's node address (through the tunnel) is not.

One cluster start for the module. Skipped where network namespaces or wireguard-go and wg are
unavailable (docs/deploy.md).
"""

from __future__ import annotations

import collections
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import wireguard
from tests.cluster.capture import Capture, ipv4_packets
from tests.cluster.netns import Network
from tests.cluster.raycluster import FAST_HEALTH_CHECKS, NodeSpec, RayCluster, ray_cluster
from tests.cluster.test_tls import MARKED_MODEL, TRAINFORGE, WEIGHTS_IN_CLEAR, in_head, send_plaintext, without_tls
from tests.helpers.faults import reports
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.config.schema import TlsConfig
from trainforge.driver.certs import CertFiles, create_certs
from trainforge.driver.tls import ray_tls_env

pytestmark = pytest.mark.slow

SPECS = [NodeSpec("head", num_cpus=0, head=True), NodeSpec("w1", num_cpus=1), NodeSpec("w2", num_cpus=1)]
CONTROL_PORT = 5301  # send_plaintext's


@pytest.fixture(scope="module")
def encrypted_network(netns_network: Network) -> Network:
    """This module's namespace network (conftest) with every node behind WireGuard."""
    reason = wireguard.unavailable()
    if reason:
        pytest.skip(f"WireGuard unavailable: {reason}")
    wireguard.encrypt(netns_network)
    return netns_network


@pytest.fixture(scope="module")
def certs(encrypted_network: Network, tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    hosts = ["localhost", "127.0.0.1", *encrypted_network.nodes.values()]
    return create_certs(tmp_path_factory.mktemp("pki"), hosts)


@pytest.fixture(scope="module")
def cluster(encrypted_network: Network, certs: CertFiles) -> Iterator[RayCluster]:
    env = ray_tls_env(TlsConfig(ca=str(certs.ca), cert=str(certs.cert), key=str(certs.key)))
    with ray_cluster(encrypted_network, SPECS, system_config=FAST_HEALTH_CHECKS, env=env) as running:
        yield running


def test_a_tls_cluster_on_an_encrypted_network_trains_with_nothing_in_clear_on_the_wire(
    cluster: RayCluster, certs: CertFiles, tmp_path: Path
) -> None:
    cluster.wait_whole()
    net = cluster.net
    marker = f"wgmarker{secrets.token_hex(8)}"
    tls = {"ca": str(certs.ca), "cert": str(certs.cert), "key": str(certs.key)}
    config = tiny_run(
        tmp_path, run={"name": marker}, model=MARKED_MODEL, scaling={"num_workers": 2}, cluster={"tls": tls}
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    argv = [TRAINFORGE, "train", str(tmp_path / "run.yaml"), "--address", cluster.gcs_address]
    tunnelled = f"tunnelledcontrol{secrets.token_hex(8)}".encode()
    clear = f"plaintextcontrol{secrets.token_hex(8)}".encode()
    with Capture(net, tmp_path / "wire.bin") as capture:
        done = in_head(cluster, argv, without_tls(cluster.env), scaled(300))
        send_plaintext(net, tunnelled)  # to w1's node address: through WireGuard
        send_plaintext(net, clear, to=net.cables["w1"])  # to w1's cable address: around it
    wire = capture.data()

    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / marker
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["global_step"] == 20 and summary["num_workers"] == 2
    nodes = {key.split("/")[1] for report in reports(run_dir) for key in report if key.startswith("system/")}
    assert nodes == {net.nodes["w1"], net.nodes["w2"]}, nodes  # one worker per worker node, on the tunnel
    assert clear in wire, "the capture did not see a plaintext connection across the switch"
    assert tunnelled not in wire, "a connection to a node address crossed the switch in clear"
    assert marker.encode() not in wire, "the run's name crossed the switch in clear"
    assert cluster.token.encode() not in wire, "the cluster's token crossed the switch in clear"
    assert WEIGHTS_IN_CLEAR not in wire, "the model's weights crossed the switch in clear"

    cables = set(net.cables.values())
    between = [p for p in ipv4_packets(wire) if p.source in cables and p.destination in cables]
    sealed = [p for p in between if p.protocol == 17 and wireguard.PORT in (p.sport, p.dport)]
    other = [p for p in between if p.protocol != 17 and CONTROL_PORT not in (p.sport, p.dport)]
    other += [p for p in between if p.protocol == 17 and wireguard.PORT not in (p.sport, p.dport)]
    kinds = collections.Counter((p.protocol, p.sport, p.dport) for p in other)
    assert not other, f"packets between the nodes outside WireGuard: {kinds.most_common(10)}"
    sealed_bytes = sum(p.size for p in sealed)
    assert sealed_bytes > 1_000_000, f"only {sealed_bytes} bytes of WireGuard during a two-node run"
    print(
        f"\n{len(wire) / 1e6:.1f} MB captured on the switch; {len(between)} IPv4 packets between the nodes, "
        f"{len(sealed)} of them WireGuard ({sealed_bytes / 1e6:.1f} MB), the rest the plaintext control; "
        "run name, token, marked weights and the tunnelled control absent, the plaintext control present"
    )
