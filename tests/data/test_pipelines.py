"""DALI (CPU-only pipeline, the real library) and PIL image pipelines on a small JPEG tree written here.

Documented tolerance between the two, on [0, 255] pixel levels: mean |DALI - PIL| <= 1 level and
max <= 8 levels (measured: ~0.2 mean, 4 max). Geometry (resized size, crop offsets, flips) is
identical; the residue comes from the two antialiased bilinear resizers rounding differently.
"""
import pytest
import torch
from PIL import Image

from image_tree import picture as _picture, write_tree

from vqlcmd.data.decode import image_batches
from vqlcmd.data.images import list_images


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("images"))
    Image.fromarray(_picture(40, 40, 9)[:, :, 0]).save(root / "ant" / "gray.jpg")  # greyscale JPEG
    Image.fromarray(_picture(30, 45, 10)).save(root / "cat" / "png.png")
    return root


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "a").mkdir()
    Image.fromarray(_picture(40, 40, 0)).save(root / "a" / "good.jpg")
    (root / "a" / "garbage.jpg").write_bytes(b"this is not a jpeg" * 10)
    (root / "a" / "empty.jpg").write_bytes(b"")
    Image.fromarray(_picture(200, 200, 1)).save(root / "a" / "truncated.jpg", quality=95)
    data = (root / "a" / "truncated.jpg").read_bytes()
    (root / "a" / "truncated.jpg").write_bytes(data[: len(data) // 2])  # header intact, pixels cut
    return root


def _all(images, backend, **kw):
    batches = list(image_batches(images, 24, 4, backend=backend, **kw))
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]), [len(y) for _, y in batches]


def test_list_images_classes_and_order(tree):
    il = list_images(tree)
    assert il.class_names == ["ant", "cat"] and len(il) == 9
    assert il.labels == [0] * 5 + [1] * 4
    assert il.files == sorted(il.files[:5]) + sorted(il.files[5:])
    flat = list_images(tree / "cat")
    assert flat.class_names == [] and set(flat.labels) == {0}


@pytest.mark.parametrize("flip", ["none", "always"])
def test_dali_and_pil_agree(tree, flip):
    il = list_images(tree)
    xd, yd, nd = _all(il, "dali", flip=flip)
    xp, yp, np_ = _all(il, "pil", flip=flip)
    assert xd.shape == xp.shape == (9, 3, 24, 24) and xd.dtype == xp.dtype == torch.float32
    assert torch.equal(yd, yp) and yd.tolist() == il.labels and nd == np_ == [4, 4, 1]
    assert xd.min() >= -1 and xd.max() <= 1
    levels = (xd - xp).abs() * 127.5
    assert levels.mean() <= 1.0, levels.mean()
    assert levels.max() <= 8.0, levels.max()


@pytest.mark.parametrize("backend", ["dali", "pil"])
def test_flip_is_an_exact_mirror(tree, backend):
    il = list_images(tree)
    plain, _, _ = _all(il, backend)
    flipped, _, _ = _all(il, backend, flip="always")
    assert torch.equal(flipped, plain.flip(-1))
    rand, _, _ = _all(il, backend, flip="random", seed=1)
    is_flip = [torch.equal(r, f) for r, f in zip(rand, flipped)]
    is_plain = [torch.equal(r, p) for r, p in zip(rand, plain)]
    assert all(a or b for a, b in zip(is_flip, is_plain)) and any(is_flip) and any(is_plain)


@pytest.mark.parametrize("backend", ["dali", "pil"])
def test_single_channel(tree, backend):
    x, _, _ = _all(list_images(tree), backend, channels=1)
    assert x.shape == (9, 1, 24, 24)


def test_unreadable_files_are_skipped_with_a_warning_naming_them(bad_tree):
    with pytest.warns(UserWarning, match=r"skipping 2 unreadable image\(s\).*empty\.jpg \(empty file\).*garbage\.jpg"):
        il = list_images(bad_tree)
    assert [f.split("/")[-1] for f in il.files] == ["good.jpg", "truncated.jpg"]
    assert len(il.skipped) == 2


@pytest.mark.parametrize("backend", ["dali", "pil"])
def test_truncated_pixels_fail_naming_the_file(bad_tree, backend):
    with pytest.warns(UserWarning):
        il = list_images(bad_tree)
    with pytest.raises((OSError, RuntimeError), match="truncated.jpg") as err:
        _all(il, backend)
    if backend == "dali":  # a file DALI could not decode: the way to skip such files up front is named
        assert "--check-images decode" in str(err.value)


def test_a_dali_failure_not_caused_by_a_file_does_not_blame_the_files(tree, monkeypatch):
    from vqlcmd.data import dali

    class Failing:
        def run(self):
            raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(dali, "build_pipeline", lambda *a, **k: Failing())
    with pytest.raises(RuntimeError, match="out of memory") as err:
        next(dali.dali_batches(list_images(tree), 24, 4))
    assert "check-images" not in str(err.value)


def test_decode_check_skips_truncated_files_up_front(bad_tree):
    with pytest.warns(UserWarning, match="truncated.jpg"):
        il = list_images(bad_tree, check="decode")
    assert [f.split("/")[-1] for f in il.files] == ["good.jpg"]
    x, _, _ = _all(il, "dali")
    assert x.shape == (1, 3, 24, 24)


def test_missing_folder_and_bad_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere' does not exist"):
        list_images(tmp_path / "nowhere")
    (tmp_path / "one.png").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"one\.png' is a file, not a folder"):
        list_images(tmp_path / "one.png")
    (tmp_path / "one.png").unlink()
    with pytest.raises(FileNotFoundError, match="no readable images"):
        list_images(tmp_path)
    (tmp_path / "x.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="flip must be one of"):
        image_batches(list_images(tmp_path, check="none"), 8, 2, flip="sometimes")
    with pytest.raises(ValueError, match="check must be"):
        list_images(tmp_path, check="maybe")


def test_images_beside_class_folders_are_an_error(tmp_path):
    # any subfolder makes the tree one class per subfolder; images at the top were then left out silently
    write_tree(tmp_path, classes=("ant",), sizes=[(20, 20)])
    Image.fromarray(_picture(20, 20, 1)).save(tmp_path / "loose.jpg")
    with pytest.raises(ValueError, match=r"holds 1 image\(s\) \(e\.g\. loose\.jpg\) beside its subfolders \['ant'\]"):
        list_images(tmp_path)
    (tmp_path / "loose.jpg").unlink()
    assert list_images(tmp_path).class_names == ["ant"]


def test_an_empty_class_folder_is_kept_with_a_warning(tmp_path):
    # a class with no image kept its label silently: the model then offered a class it never saw
    write_tree(tmp_path, classes=("ant", "cat"), sizes=[(20, 20), (20, 21)])
    (tmp_path / "bee").mkdir()
    with pytest.warns(UserWarning, match=r"1 class folder\(s\) under .* hold no readable image: \['bee'\]"):
        il = list_images(tmp_path)
    # the other classes keep the numbers their folder names give them
    assert il.class_names == ["ant", "bee", "cat"] and sorted(set(il.labels)) == [0, 2]


@pytest.fixture(scope="module")
def camera_tree(tmp_path_factory):
    """An upright JPEG, the same picture stored rotated with an EXIF orientation tag that puts it upright
    (as phones save), and a 16-bit greyscale PNG."""
    import numpy as np

    root = tmp_path_factory.mktemp("camera")
    upright = Image.fromarray(_picture(40, 64, 3))
    upright.save(root / "a_upright.jpg", quality=97)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    upright.transpose(Image.Transpose.ROTATE_90).save(root / "b_exif6.jpg", quality=97, exif=exif)
    ramp = np.tile(np.linspace(0, 65535, 48).round().astype(np.uint16), (32, 1))
    Image.fromarray(ramp).save(root / "c_gray16.png")
    return root


@pytest.mark.parametrize("backend", ["dali", "pil"])
def test_exif_orientation_is_applied(camera_tree, backend):
    x, _, _ = _all(list_images(camera_tree), backend)
    levels = (x[1] - x[0]).abs() * 127.5  # the tagged copy shows as the upright picture (JPEG noise apart)
    assert levels.mean() <= 3.0, levels.mean()


@pytest.mark.parametrize("backend", ["dali", "pil"])
def test_16_bit_images_are_scaled_not_clipped(camera_tree, backend):
    import numpy as np

    x, _, _ = _all(list_images(camera_tree), backend)
    got = (x[2, 0] * 127.5 + 127.5).mean(0)  # column means of a 0..65535 left-to-right ramp
    # 32 x 48 resized to 24 x 36, centre crop columns 6..29: source column (j + 0.5) * 48 / 36 - 0.5, in 8 bits
    src = (torch.arange(6, 30, dtype=torch.float64) + 0.5) * 48 / 36 - 0.5
    want = (src * 255 / 47).float()
    assert (got - want).abs().max() <= 8.0, (got - want).abs().max()


def test_an_image_over_pils_pixel_limit_is_skipped_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # DecompressionBombError from 2000 pixels up
    Image.fromarray(_picture(40, 60, 0)).save(tmp_path / "big.png")
    Image.fromarray(_picture(10, 10, 1)).save(tmp_path / "small.png")
    with pytest.warns(UserWarning, match=r"skipping 1 unreadable image\(s\).*big\.png \(over PIL's pixel limit"):
        il = list_images(tmp_path)
    assert [f.split("/")[-1] for f in il.files] == ["small.png"]
    with pytest.raises(OSError, match="big.png"):
        _all(list_images(tmp_path, check="none"), "pil")


def test_float_and_32_bit_integer_images_are_skipped_naming_the_mode(tmp_path):
    """PIL turned a float TIFF (values in [0, 1]) all black and an int32 one all white; DALI failed on the
    second: their range is unknown, so they are skipped up front with the reason."""
    import numpy as np

    Image.fromarray(np.random.default_rng(0).random((12, 12), dtype=np.float32), "F").save(tmp_path / "f.tif")
    Image.fromarray(np.full((12, 12), 70000, dtype=np.int32), "I").save(tmp_path / "i.tif")
    Image.fromarray(_picture(10, 10, 1)).save(tmp_path / "ok.png")
    with pytest.warns(UserWarning, match=r"skipping 2 unreadable image\(s\).*f\.tif \(32-bit float pixels \(mode F\)"
                                         r".*i\.tif \(32-bit integer pixels \(mode I\)"):
        il = list_images(tmp_path)
    assert [f.split("/")[-1] for f in il.files] == ["ok.png"]
    # Pillow up to 10.x opened 16-bit PNGs as mode "I": its tile's raw mode tells them from 32-bit ones
    from vqlcmd.data.images import _sixteen_bit

    class OldPillowPng:
        mode, tile = "I", [("zip", (0, 0, 4, 4), 0, "I;16B")]

    with Image.open(tmp_path / "i.tif") as im:
        assert _sixteen_bit(OldPillowPng()) and not _sixteen_bit(im)


def test_linked_folders_inside_a_class_are_followed(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    Image.fromarray(_picture(10, 10, 0)).save(tmp_path / "elsewhere" / "linked.png")
    (tmp_path / "tree" / "a").mkdir(parents=True)
    Image.fromarray(_picture(10, 10, 1)).save(tmp_path / "tree" / "a" / "own.png")
    (tmp_path / "tree" / "a" / "more").symlink_to(tmp_path / "elsewhere")
    il = list_images(tmp_path / "tree")
    assert [f.split("/")[-1] for f in il.files] == ["own.png", "linked.png"]
