import pytest

from radixserve import envs


def test_bool_rule_is_one_rule(monkeypatch):
    for raw, want in [("1", True), ("TRUE", True), (" on ", True), ("yes", True),
                      ("0", False), ("false", False), ("Off", False), ("no", False)]:
        monkeypatch.setenv("RADIXSERVE_STRICT_CHECKS", raw)
        assert envs.STRICT_CHECKS.get() is want, raw


def test_unset_and_empty_take_the_default(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_CPU_PREFILL_KERNEL", raising=False)
    assert envs.CPU_PREFILL_KERNEL.get() is True
    monkeypatch.setenv("RADIXSERVE_CPU_PREFILL_KERNEL", "")
    assert envs.CPU_PREFILL_KERNEL.get() is True
    monkeypatch.setenv("RADIXSERVE_STARVATION_TIMEOUT_S", "")
    assert envs.STARVATION_TIMEOUT_S.get() == 30.0


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_DEBUG_ALLOC", "maybe")
    with pytest.raises(envs.EnvError, match="RADIXSERVE_DEBUG_ALLOC='maybe'"):
        envs.DEBUG_ALLOC.get()
    monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "x")
    with pytest.raises(envs.EnvError, match="RADIXSERVE_TEST_RETRACT_INTERVAL"):
        envs.TEST_RETRACT_INTERVAL.get()


def test_typed_values(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    assert envs.CACHE_DIR.get() == tmp_path
    monkeypatch.setenv("RADIXSERVE_FORWARD_READ_DELAY_S", "0.25")
    assert envs.FORWARD_READ_DELAY_S.get() == 0.25


def test_every_switch_is_declared_once_and_documented():
    names = [v.name for v in envs.REGISTRY]
    assert len(names) == len(set(names))
    assert all(n.startswith("RADIXSERVE_") for n in names)
    text = envs.describe()
    assert all(n in text for n in names)


def test_no_module_reads_a_radixserve_switch_directly():
    import re
    from pathlib import Path

    import radixserve

    direct = re.compile(r"(environ(\.get)?|getenv)\s*[\[(]\s*[\"']RADIXSERVE_")
    root = Path(radixserve.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "envs.py" and direct.search(p.read_text())]
    assert offenders == []
