"""Audit of ``hs.ImageFolder`` against PIL by hand and torchvision's documented transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hookscope as hs

Image = pytest.importorskip("PIL.Image")


def _save(path, array, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return path


def test_default_preprocessing_is_torchvisions_to_the_pixel(tmp_path):
    # (301, 457) made the long side 389 (round) where torchvision's Resize makes 388 (int), and
    # odd margins cropped one pixel off torchvision's CenterCrop (floor against round): 2.6 off
    T = pytest.importorskip("torchvision.transforms")
    ref = T.Compose(
        [
            T.Resize(256),
            T.CenterCrop(224),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    rng = np.random.default_rng(0)
    sizes = [(301, 457), (640, 427), (333, 500), (256, 300), (480, 641), (225, 224)]
    for i, (h, w) in enumerate(sizes):
        _save(tmp_path / f"{i}.png", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    ds = hs.ImageFolder(tmp_path)
    for i in range(len(ds)):
        with Image.open(ds.samples[i][0]) as im:
            expected = ref(im.convert("RGB"))
        assert torch.equal(ds[i][0], expected), sizes[i]


@pytest.mark.parametrize(
    ("array", "mode"),
    [
        ((np.arange(64).reshape(8, 8) * 1000).astype(np.uint16), "I;16"),
        (np.full((8, 8), 0.5, np.float32), "F"),
    ],
)
def test_wide_images_are_refused_not_clipped(tmp_path, array, mode):
    # PIL's convert("RGB") clipped a 16-bit PNG to 255 (a white picture) and a float TIFF's 0.5 to
    # 0, silently; the file is now named with the fix
    path = _save(tmp_path / ("a.png" if mode != "F" else "a.tif"), array)
    with Image.open(path) as im:
        assert im.mode == mode
    ds = hs.ImageFolder(tmp_path, image_size=None)
    with pytest.raises(OSError, match=r"a\.(png|tif).*PIL mode.*clips.*8 bits"):
        ds[0]


def test_eight_bit_modes_read_as_pil_convert_rgb(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (6, 7, 4), dtype=np.uint8)
    _save(tmp_path / "gray.png", rgb[..., 0])
    _save(tmp_path / "rgba.png", rgba)
    Image.fromarray(rgb).convert("P").save(tmp_path / "pal.png")
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "cmyk.jpg")
    Image.fromarray(rgb).save(tmp_path / "rgb16.tiff")
    ds = hs.ImageFolder(tmp_path, image_size=None)
    for i, (path, _) in enumerate(ds.samples):
        with Image.open(path) as im:
            expected = np.asarray(im.convert("RGB"), np.float32) / 255.0
        mean, std = (
            np.array([0.485, 0.456, 0.406], np.float32),
            np.array([0.229, 0.224, 0.225], np.float32),
        )
        expected = torch.from_numpy(((expected - mean) / std).transpose(2, 0, 1).copy())
        assert torch.equal(ds[i][0], expected), path


def _tiny(path):
    return _save(path, np.zeros((4, 4, 3), np.uint8))


def test_symlinked_class_folder_and_broken_link_are_seen(tmp_path):
    # rglob did not enter a symlinked class folder ('bird' vanished, its label given to 'cat')
    # and dropped a link to a missing file; torchvision's os.walk(followlinks=True) sees both
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _tiny(elsewhere / "bird" / "b.png")
    _tiny(root / "cat" / "c.png")
    (root / "bird").symlink_to(elsewhere / "bird")
    (root / "cat" / "gone.png").symlink_to(elsewhere / "missing.png")
    (root / "cat" / "loop").symlink_to(root)  # a cycle ends
    ds = hs.ImageFolder(root, image_size=None)
    assert ds.classes == ["bird", "cat"]
    assert ds.files[:3] == ["bird/b.png", "cat/c.png", "cat/gone.png"]
    assert [lab for _, lab in ds.samples[:3]] == [0, 1, 1]
    with pytest.raises(OSError, match="gone.png"):
        ds.load(2)
    tv = pytest.importorskip("torchvision.datasets")
    ref = tv.ImageFolder(str(root))
    assert ref.classes == ds.classes
    assert ref.samples[0][1] == ds.samples[0][1]


def test_empty_class_folder_keeps_its_label_and_is_said(tmp_path):
    # the empty 'a' was dropped from classes, so 'b' got label 0 where torchvision gives it 1
    (tmp_path / "a").mkdir()
    _tiny(tmp_path / "b" / "x.png")
    with pytest.warns(hs.HookscopeWarning, match=r"'a' hold no image"):
        ds = hs.ImageFolder(tmp_path, image_size=None)
    assert ds.classes == ["a", "b"] and ds[0][1] == 1


def test_files_beside_class_folders_are_said_to_share_label_0(tmp_path):
    _tiny(tmp_path / "b" / "x.png")
    _tiny(tmp_path / "top.png")
    with pytest.warns(hs.HookscopeWarning, match=r"'top.png'.*label 0.*class 'b'"):
        ds = hs.ImageFolder(tmp_path, image_size=None)
    assert [lab for _, lab in ds.samples] == [0, 0]


def test_flat_folder_unicode_and_case_names(tmp_path):
    for name in ["é.PNG", "a.png", "A.png", ".hidden.png"]:
        _tiny(tmp_path / name)
    (tmp_path / "z.txt").write_text("not an image")
    ds = hs.ImageFolder(tmp_path, image_size=None)
    assert ds.files == sorted([".hidden.png", "A.png", "a.png", "é.PNG"])
    assert ds.classes == [] and {lab for _, lab in ds.samples} == {0}
    assert ds.sample_id(3) == "é.PNG" and ds[3][0].shape == (3, 4, 4)


def test_truncated_file_fails_even_with_pils_load_truncated_images(tmp_path, monkeypatch):
    # with PIL.ImageFile.LOAD_TRUNCATED_IMAGES set (by a library or a script), half a JPEG
    # decoded with its lower half grey, silently, where the docstring promises an error
    import io

    from PIL import ImageFile

    buf = io.BytesIO()
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    (tmp_path / "t.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (tmp_path / "u.txt.png").write_text("not an image")
    ds = hs.ImageFolder(tmp_path, image_size=None)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(OSError, match=r"t\.jpg.*truncated"):
        ds[0]
    with pytest.raises(OSError, match=r"u\.txt\.png"):
        ds[1]
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True
