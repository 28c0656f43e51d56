"""Data and weights paths: links cannot loop or duplicate, special files and /proc are refused."""

import os
from pathlib import Path

import pytest

from nbddp import DataError, WeightsError
from nbddp.checkpoint import load_state_dict_file
from nbddp.data import scan_class_folders
from nbddp.models import check_weights_file
from conftest import make_tree


@pytest.fixture
def data(tmp_path):
    return make_tree(tmp_path / "data", per_class=4)


def test_link_to_its_own_class_folder_adds_no_sample(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "again").symlink_to(".")
    with pytest.warns(UserWarning, match=r"already scanned.*counted once: a/again"):
        classes, samples = scan_class_folders(data)
    assert samples == plain and len(samples) == 12


@pytest.mark.timeout(60)  # today's walk is exponential here: it would hang, not fail
def test_two_loop_links_finish_at_once(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "x").symlink_to(".")
    (data / "a" / "y").symlink_to(".")
    (data / "b" / "up").symlink_to("..")  # back to the data folder: every class again
    with pytest.warns(UserWarning, match=r"3 folder link"):
        assert scan_class_folders(data)[1] == plain


def test_link_to_another_class_keeps_its_images_in_that_class(data):
    _, plain = scan_class_folders(data)
    (data / "a" / "more").symlink_to("../b")
    (data / "a" / "b_copy.png").symlink_to("../b/000.png")  # a file reached twice
    with pytest.warns(UserWarning) as record:
        assert scan_class_folders(data)[1] == plain
    text = " ".join(str(w.message) for w in record)
    assert "a/more" in text and "a/b_copy.png" in text


def test_a_class_folder_that_is_another_class_is_refused(data):
    (data / "d").symlink_to("b")
    with pytest.raises(DataError, match=r"'b' and 'd' in .* are the same folder"):
        scan_class_folders(data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/proc/self", "/proc", "/sys"])
def test_pseudo_filesystems_are_refused(path):
    with pytest.raises(DataError, match=r"pseudo-filesystem.*not a folder of images"):
        scan_class_folders(path)


@pytest.mark.timeout(60)
def test_link_into_proc_is_refused(data):
    (data / "a" / "p").symlink_to("/proc/self")
    with pytest.raises(DataError, match=r"a/p.*pseudo-filesystem"):
        scan_class_folders(data)


def test_fifo_named_like_an_image_is_refused(data):
    os.mkfifo(data / "b" / "pipe.png")
    with pytest.raises(DataError, match=r"b/pipe\.png is a FIFO.*not an image file"):
        scan_class_folders(data)


def test_fifo_as_data_path_is_refused(tmp_path):
    os.mkfifo(tmp_path / "data")
    with pytest.raises(DataError, match=r"is a FIFO"):
        scan_class_folders(tmp_path / "data")


@pytest.mark.timeout(60)  # today's open() of a FIFO waits for a writer forever
def test_fifo_weights_are_refused(tmp_path):
    fifo = tmp_path / "weights.pth"
    os.mkfifo(fifo)
    with pytest.raises(WeightsError, match=r"weights\.pth is a FIFO.*not a weights file"):
        check_weights_file(fifo, "resnet18", 3)
    with pytest.raises(WeightsError, match=r"is a FIFO"):
        load_state_dict_file(fifo)


@pytest.mark.timeout(60)
def test_proc_file_as_weights_is_refused():
    with pytest.raises(WeightsError, match=r"pseudo-filesystem"):
        load_state_dict_file("/proc/self/environ")
