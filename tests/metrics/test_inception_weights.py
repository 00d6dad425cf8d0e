"""The Inception weights file (vqlcmd/metrics/inception.py) is hash-checked and loaded weights-only: a
malicious .pth is refused by name and its pickled call never runs; good weights give torch-fidelity's
own module's features."""
import numpy as np
import pytest
import torch

from vqlcmd.metrics import inception
from vqlcmd.metrics.inception import InceptionFeatures, UnsafeWeightsError


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.fixture
def evil_weights(tmp_path, inception_net):
    """Real-looking weights with one pickled call beside them, under the release's file name."""
    path = tmp_path / "evil" / inception.WEIGHTS_FILE
    path.parent.mkdir()
    torch.save({**inception_net.state_dict(), "fc.extra": _Evil(tmp_path / "MARKER")}, path)
    return path


def test_torch_fidelitys_own_loader_runs_the_file(evil_weights, tmp_path):
    # the "before": what evaluate.py --inception-weights did (torch-fidelity's torch.load(weights_only=False))
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    with pytest.raises(RuntimeError):  # fc.extra is no parameter: only after the pickle has run
        FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(evil_weights))
    assert (tmp_path / "MARKER").exists()


def test_a_malicious_weights_file_is_refused_by_name_and_nothing_runs(evil_weights, tmp_path):
    with pytest.raises(ValueError, match=rf"{evil_weights}: SHA-256 [0-9a-f]{{64}} is not that of torch-fidelity's"):
        InceptionFeatures(evil_weights)  # the hash first: no byte of the pickle is read
    with pytest.raises(UnsafeWeightsError) as err:
        InceptionFeatures(evil_weights, verify=False)  # without the hash, the weights-only load refuses it
    msg = str(err.value)
    assert msg.startswith(f"{evil_weights}: refused to load") and "GLOBAL exec" in msg and "nothing from it" in msg
    assert "add_safe_globals" not in msg
    assert not (tmp_path / "MARKER").exists()


def test_evaluate_script_refuses_a_malicious_file_by_name(load_script, evil_weights, tmp_path):
    evaluate = load_script("evaluate")
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    for extra in ([], ["--any-inception-weights"]):
        with pytest.raises(SystemExit, match=str(evil_weights)):
            evaluate.main([str(tmp_path / "s.npz"), "--metrics", "is", "--inception-weights", str(evil_weights), *extra])
    assert not (tmp_path / "MARKER").exists()


def test_good_weights_give_torch_fidelitys_features(inception_net, inception_weights):
    images = torch.randint(0, 256, (3, 3, 40, 40), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    with torch.no_grad():
        pool, logits = inception_net(images)
    got = InceptionFeatures(inception_weights, verify=False)(images)
    assert got["pool"].shape == (3, 2048) and got["logits"].shape == (3, 1008)
    assert np.array_equal(got["pool"], pool.double().numpy()) and np.array_equal(got["logits"], logits.double().numpy())
    assert pool.std() > 0  # not a degenerate network whose features are trivially equal


def test_the_release_hash_is_accepted(inception_weights, monkeypatch):
    monkeypatch.setattr(inception, "WEIGHTS_SHA256", inception.file_sha256(inception_weights))
    assert InceptionFeatures(inception_weights).net.fc.out_features == 1008
    assert inception.WEIGHTS_SHA256 != "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
    monkeypatch.undo()
    assert inception.WEIGHTS_SHA256.startswith("6726825d")  # the release name's hash prefix (torch hub's convention)


def test_another_network_or_a_non_state_dict_is_named(tmp_path):
    other = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(2, 2)}, other)
    with pytest.raises(ValueError, match=r"other\.pth is not torch-fidelity's Inception-v3"):
        InceptionFeatures(other, verify=False)
    listed = tmp_path / "list.pth"
    torch.save([torch.zeros(2)], listed)
    with pytest.raises(ValueError, match=r"list\.pth is not torch-fidelity's .* holds a list, not a state dict"):
        InceptionFeatures(listed, verify=False)
