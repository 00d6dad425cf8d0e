import pytest
import torch


@pytest.fixture(scope="session")
def inception_net():
    """A randomly initialised torch-fidelity Inception-v3 (none can be downloaded), built without loading weights."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    cls = fe.FeatureExtractorInceptionV3
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        mp.setattr(cls, "load_state_dict", lambda self, sd, *a, **k: None)
        torch.manual_seed(0)
        net = cls("inception-v3-compat", ["2048", "logits_unbiased"])
    for m in net.modules():  # He init keeps activations O(1) through the ~20 layers (the default shrinks them)
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return net.eval()


@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory, inception_net):
    """``inception_net`` saved as torch-fidelity's weights file (its name, not its bytes)."""
    path = tmp_path_factory.mktemp("inception") / "weights-inception-2015-12-05-6726825d.pth"
    torch.save(inception_net.state_dict(), path)
    return path
