"""scripts/evaluate.py never unpickles an .npz member: an object array (stored as a pickle) in the samples or
the reference is refused by name and its pickled call never runs."""
import numpy as np
import pytest


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _evil_array(marker):
    arr = np.empty(2, dtype=object)
    arr[0] = _Evil(marker)
    return arr


@pytest.mark.parametrize("where", ["samples", "labels", "ref-images", "ref-stats"])
def test_a_pickled_npz_member_is_refused_by_name_and_nothing_runs(load_script, tmp_path, monkeypatch, where):
    evaluate = load_script("evaluate")
    marker = tmp_path / "MARKER"
    good = np.zeros((4, 8, 8, 3), np.uint8)
    bad = tmp_path / "bad.npz"
    member = {"samples": "arr_0", "labels": "arr_1", "ref-images": "arr_0", "ref-stats": "mu"}[where]
    content = {"samples": dict(arr_0=_evil_array(marker)), "labels": dict(arr_0=good, arr_1=_evil_array(marker)),
               "ref-images": dict(arr_0=_evil_array(marker)),
               "ref-stats": dict(mu=_evil_array(marker), sigma=np.eye(2))}[where]
    np.savez(bad, **content)
    np.savez(tmp_path / "good.npz", arr_0=good)
    argv = {"samples": [str(bad), "--digits"], "labels": [str(bad), "--digits"],
            "ref-images": [str(tmp_path / "good.npz"), "--ref", str(bad), "--metrics", "fid"],
            "ref-stats": [str(tmp_path / "good.npz"), "--ref", str(bad), "--metrics", "fid"]}[where]
    if where.startswith("ref"):  # the reference is read after the samples are encoded: any extractor will do
        import vqlcmd.metrics.inception as inc

        class _Fake:
            def __init__(self, *a, **k):
                pass

            def __call__(self, batches):
                n = sum(len(b) for b in batches)
                return {"pool": np.random.default_rng(0).normal(size=(n, 4)), "logits": np.zeros((n, 3))}

        monkeypatch.setattr(inc, "InceptionFeatures", _Fake)
        argv += ["--inception-weights", str(tmp_path / "w.pth")]
        (tmp_path / "w.pth").write_bytes(b"")
    with pytest.raises(SystemExit) as err:
        evaluate.main(argv)
    assert str(err.value).startswith(f"{bad}: '{member}' is an object array, stored as a pickle, which is never "
                                     "loaded"), str(err.value)
    assert not marker.exists()
    np.load(bad, allow_pickle=True)[member]  # the file is live: a pickle-allowing load runs it
    assert marker.exists()
