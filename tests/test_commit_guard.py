"""Within one process, a checkpoint folder being committed is never removed, and one being removed is
never committed (`CommitGuard`): pure, no storage, no Ray."""

from __future__ import annotations

import pickle
import threading

import pytest

from elastic_train.checkpoint.guard import CommitGuard
from elastic_train.checkpoint.layout import Attempt
from elastic_train.checkpoint.storage import RunStorage

FOUR = Attempt(4, 1)


@pytest.mark.timeout(10)
def test_a_folder_being_committed_is_not_claimed_for_removal_until_every_commit_of_it_ends():
    guard = CommitGuard()
    assert guard.begin_commit(FOUR) and guard.begin_commit(FOUR)
    assert not guard.begin_removal(FOUR)
    guard.end_commit(FOUR)
    assert not guard.begin_removal(FOUR)
    guard.end_commit(FOUR)
    assert guard.begin_removal(FOUR)
    assert guard.begin_removal(Attempt(5, 1))  # another folder is free


@pytest.mark.timeout(10)
def test_a_folder_being_removed_is_not_committed_nor_removed_twice():
    guard = CommitGuard()
    assert guard.begin_removal(FOUR)
    assert not guard.begin_commit(FOUR) and not guard.begin_removal(FOUR)
    guard.end_removal(FOUR)
    assert guard.begin_commit(FOUR)


@pytest.mark.timeout(10)
def test_waiting_for_commits_returns_once_the_last_one_ends():
    guard = CommitGuard()
    assert guard.wait_for_commits(0.0)
    guard.begin_commit(FOUR)
    assert not guard.wait_for_commits(0.0)
    threading.Timer(0.05, guard.end_commit, (FOUR,)).start()
    assert guard.wait_for_commits(5.0)


@pytest.mark.timeout(10)
def test_a_copy_of_a_run_storage_starts_with_nothing_committed_or_removed(tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    storage.begin_commit(FOUR)
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.root == storage.root and copy.wait_for_commits(0.0)
    assert not storage.wait_for_commits(0.0)
