"""The tensor pipeline's decoded images are kept between launches (nbddp.tasks.classification.decoded_store).

A relaunch over the same files reads them back instead of decoding; an edited photo is decoded
again; a stored file that is not the user's alone, or cut short, is never read; ranks started
together decode once between them; the folder stays under its cap, least recently used first.
"""

import hashlib
import multiprocessing as mp
import os
import stat
import warnings

import pytest
import torch
from PIL import Image

from nbddp.contract import private
from nbddp.tasks.classification import decoded_store as DS
from nbddp.tasks.classification.tensor_data import TensorCache

from conftest import OTHER_UID  # give_away: the fixture, from conftest

CPU = torch.device("cpu")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store's folder in a cache home of the test's own, under a team's umask (002)."""
    home = tmp_path / "cache"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv(DS.CAP_VAR, raising=False)
    old = os.umask(0o002)
    yield home / "nbddp" / "decoded"
    os.umask(old)


def photos(folder, n=12, seed=0, name="p"):
    """``n`` small photos of random pixels (PNG: the decoded pixels are the saved ones), as samples."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        path = folder / f"{name}{i}.png"
        Image.fromarray(torch.randint(0, 256, (30, 40, 3), generator=g, dtype=torch.uint8).numpy()).save(path)
        samples.append((str(path), i % 3))
    return samples


def decoded_without_store(samples, monkeypatch, image_size=32):
    with monkeypatch.context() as m:
        m.setenv(DS.CAP_VAR, "0")
        cache = TensorCache(samples, image_size, CPU)
    assert cache.decoded == len(samples)
    return cache.images


def stored_files(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith(DS.SUFFIX)) if folder.exists() else []


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_second_cache_over_the_same_photos_decodes_nothing_and_is_the_same(store, tmp_path):
    samples = photos(tmp_path / "data")
    first = TensorCache(samples, 32, CPU)
    second = TensorCache(samples, 32, CPU)
    assert first.decoded == len(samples) and second.decoded == 0
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    # a private folder and file of the user's whatever the umask (002 here)
    (stored,) = stored_files(store)
    assert mode(store) == 0o700 and mode(store.parent) == 0o700 and mode(stored) == 0o600
    assert not [p for p in store.iterdir() if p.name.endswith(".tmp")]
    # another load size is another file
    other = TensorCache(samples, 24, CPU)
    assert other.decoded == len(samples) and len(stored_files(store)) == 2


def test_an_edited_photo_is_decoded_again(store, tmp_path, monkeypatch):
    samples = photos(tmp_path / "data")
    before = TensorCache(samples, 32, CPU)
    # the same name, new pixels and a new mtime
    Image.fromarray(torch.full((30, 40, 3), 7, dtype=torch.uint8).numpy()).save(samples[3][0])
    after = TensorCache(samples, 32, CPU)
    assert after.decoded == len(samples)
    assert (after.images[3] == 7).all() and not torch.equal(after.images[3], before.images[3])
    assert torch.equal(after.images, decoded_without_store(samples, monkeypatch))
    # a relabelled photo too (the stored labels would be fine, but the key says what was decoded)
    relabelled = [(p, (c + 1) % 3) for p, c in samples]
    assert TensorCache(relabelled, 32, CPU).decoded == len(samples)


def poisoned(path):
    """The stored file at ``path`` with its pixels replaced by 255s, header kept: read back, it shows."""
    data = path.read_bytes()
    n_pixels = 12 * 3 * 36 * 36  # photos()' 12 images at load size 36 (image size 32)
    return data[:-n_pixels] + b"\xff" * n_pixels


def plant(kind, path, bad, give_away, tmp_path):
    path.unlink()
    if kind == "own":  # the control: a file of the user's alone is read back as it is
        path.write_bytes(bad)
        path.chmod(0o600)
    elif kind == "another user's":
        path.write_bytes(bad)
        path.chmod(0o600)
        give_away(path)
    elif kind == "group-writable":
        path.write_bytes(bad)
        path.chmod(0o660)
    elif kind == "a symbolic link":
        target = tmp_path / "elsewhere.u8"
        target.write_bytes(bad)
        target.chmod(0o600)
        path.symlink_to(target)
    elif kind == "hard-linked":
        path.write_bytes(bad)
        path.chmod(0o600)
        os.link(path, tmp_path / "second-name.u8")
    elif kind == "truncated":
        path.write_bytes(bad[:len(bad) // 2])
        path.chmod(0o600)


@pytest.mark.parametrize("kind, warning", [
    ("another user's", f"is owned by uid {OTHER_UID}"),
    ("group-writable", "may be written by other users"),
    ("a symbolic link", "is a symbolic link"),
    ("hard-linked", "has other names"),
    ("truncated", None),
])
def test_a_stored_file_not_the_users_alone_or_cut_short_is_not_used(store, tmp_path, monkeypatch, give_away,
                                                                   kind, warning):
    samples = photos(tmp_path / "data")
    TensorCache(samples, 32, CPU)
    (path,) = stored_files(store)
    plant(kind, path, poisoned(path), give_away, tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache = TensorCache(samples, 32, CPU)
    ours = [str(w.message) for w in seen if "decoded images" in str(w.message)]
    assert cache.decoded == len(samples)
    assert torch.equal(cache.images, decoded_without_store(samples, monkeypatch))
    if warning is None:
        assert ours == []  # stale or cut short: silently decoded again
    else:
        assert len(ours) == 1 and str(path) in ours[0] and warning in ours[0], ours
    # stored anew in its place, a private file of the user's, read back by the next launch
    assert not path.is_symlink() and mode(path) == 0o600 and os.lstat(path).st_nlink == 1
    assert private.owner(os.lstat(path)) == os.getuid()
    assert TensorCache(samples, 32, CPU).decoded == 0


def test_the_control_a_private_file_of_the_users_is_read_back_as_it_is(store, tmp_path, give_away):
    # What the test above plants would show in the images if it were read.
    samples = photos(tmp_path / "data")
    TensorCache(samples, 32, CPU)
    (path,) = stored_files(store)
    plant("own", path, poisoned(path), give_away, tmp_path)
    cache = TensorCache(samples, 32, CPU)
    assert cache.decoded == 0 and (cache.images == 255).all()


def build(samples, start, results):
    """A rank's cache build in a fresh interpreter: how many images it decoded, and a digest of them."""
    start.wait()
    try:
        cache = TensorCache(samples, 32, CPU)
        results.put((cache.decoded, hashlib.sha256(cache.images.numpy().tobytes()).hexdigest()))
    except BaseException as exc:  # said in the test's failure, not a wait for a result that never comes
        results.put((repr(exc), None))
        raise


def test_ranks_started_together_decode_the_photos_once_between_them(store, tmp_path, monkeypatch):
    samples = photos(tmp_path / "data", n=96)
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(3), ctx.Queue()
    ranks = [ctx.Process(target=build, args=(samples, start, results)) for _ in range(3)]
    for p in ranks:
        p.start()
    got = [results.get(timeout=300) for _ in ranks]
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0, 0], got
    assert sum(decoded for decoded, _ in got) == len(samples), got
    want = hashlib.sha256(decoded_without_store(samples, monkeypatch).numpy().tobytes()).hexdigest()
    assert {digest for _, digest in got} == {want}
    assert len(stored_files(store)) == 1


def test_the_store_is_kept_under_its_cap_least_recently_used_first(store, tmp_path, monkeypatch):
    lists = [photos(tmp_path / f"data{i}", seed=i) for i in range(3)]
    TensorCache(lists[0], 32, CPU)
    (a,) = stored_files(store)
    size = a.stat().st_size
    monkeypatch.setenv(DS.CAP_VAR, repr(2.5 * size / 2**30))  # room for two
    TensorCache(lists[1], 32, CPU)
    b = next(p for p in stored_files(store) if p != a)
    os.utime(a, (1000, 1000))  # a is older than b ...
    os.utime(b, (2000, 2000))
    assert TensorCache(lists[0], 32, CPU).decoded == 0  # ... until it is read: a read touches it
    TensorCache(lists[2], 32, CPU)
    kept = stored_files(store)
    assert a in kept and b not in kept and len(kept) == 2
    assert not (store / b.name.replace(DS.SUFFIX, ".lock")).exists()
    # a file larger than the cap is not stored, and nothing is removed for it
    monkeypatch.setenv(DS.CAP_VAR, repr(0.5 * size / 2**30))
    assert TensorCache(lists[1], 32, CPU).decoded == len(lists[1]) and stored_files(store) == kept


def test_a_cap_of_0_keeps_nothing_and_a_bad_cap_is_named(store, tmp_path, monkeypatch):
    samples = photos(tmp_path / "data", n=3)
    monkeypatch.setenv(DS.CAP_VAR, "0")
    assert TensorCache(samples, 32, CPU).decoded == 3 and TensorCache(samples, 32, CPU).decoded == 3
    assert not store.exists()
    monkeypatch.setenv(DS.CAP_VAR, "20GB")
    with pytest.raises(ValueError, match=rf"{DS.CAP_VAR}='20GB' is not a size in GiB.*or 0"):
        TensorCache(samples, 32, CPU)
