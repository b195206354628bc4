"""The suite's own guard (conftest.py): a run without room for what it writes stops before its first test and says,
for each filesystem short of room, how much is free, how much the run writes there and what."""

import conftest


def test_a_run_short_of_disk_names_each_filesystem_and_what_it_would_write(tmp_path, monkeypatch):
    checkout, tmp = tmp_path / "checkout", tmp_path / "tmp"
    checkout.mkdir(), tmp.mkdir()
    (checkout / ".venv-speculators" / "bin").mkdir(parents=True)
    (checkout / ".venv-speculators" / "bin" / "python").write_text("")  # built already: writes nothing more
    monkeypatch.setattr(conftest, "SUITE_TMP_GIB", 10**6)
    monkeypatch.setattr(conftest, "ENVIRONMENT_DIRS", {"vllm": (".venv-vllm", 3.0), "interop": (".venv-speculators",
                                                                                                 2.0)})
    [line] = conftest.disk_shortfalls({"vllm", "interop"}, tmp, checkout)  # one filesystem: one line, summed
    assert f"{tmp}'s filesystem has " in line and "this run writes about 1000003.0 GiB there" in line
    assert f"the tests' temporary folders under {tmp}" in line and "scripts/setup_vllm.sh" in line
    assert "speculators" not in line
    [line] = conftest.disk_shortfalls(set(), tmp, checkout)  # no test of vLLM's selected: its environment not counted
    assert "about 1000000.0 GiB" in line and "vllm" not in line
    monkeypatch.setattr(conftest, "SUITE_TMP_GIB", 0.0)
    assert conftest.disk_shortfalls({"interop"}, tmp, checkout) == []
