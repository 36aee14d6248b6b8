"""The plugin contract end to end on a tiny checkpoint: per-engine state through EngineContext, logits processors
from LLM and from a plugin (n > 1, asynchronous scheduling), bad_words, hooks that raise, strict loading, --option on
the command line, and the backend report."""

from __future__ import annotations

import pytest
from v4_factory import tiny_checkpoint

from deepinfer_core import LLM, SamplingParams, plugins
from deepinfer_core.backends import registry
from deepinfer_core.backends.base import ProbeResult
from deepinfer_core.cli.main import _format_env, env_report, main
from deepinfer_core.cli.options import CommandLineOptionError, parse_options
from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.errors import PluginHookError, StrictPluginsError, UnknownOptionError
from deepinfer_core.sampling import LogitsProcessor

pytest.importorskip("transformers")

HEADER = "from deepinfer_core.hookspecs import hookimpl\nDEEPINFER_HOOK_API_VERSION = 1\n"

# Claims option `ban_id`: every request of an engine built with it never samples that id (per-engine state).
BANNER = HEADER + """
import torch
from deepinfer_core.sampling import LogitsProcessor

class Ban(LogitsProcessor):
    def __init__(self, token_id):
        self.token_id = token_id
    def __call__(self, logits, rows):
        logits[:, self.token_id] = float("-inf")
        return logits

@hookimpl
def deepinfer_feature_options():
    return {"ban_id": "a token id no request of the engine samples"}

@hookimpl
def deepinfer_configure(options, context):
    context.plugin_state["banner"] = options.get("ban_id")

@hookimpl
def deepinfer_logits_processors(context):
    token_id = context.plugin_state["banner"]
    return None if token_id is None else [Ban(token_id)]
"""

AFTER_STEP_RAISES = HEADER + """
@hookimpl
def deepinfer_after_step(model_output):
    raise KeyError("no such row")
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract") / "ckpt"
    tiny_checkpoint(folder)
    return folder


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    monkeypatch.setenv(plugins.ENV_PLUGINS, "none")
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


def _install(make_distribution, monkeypatch, name: str, source: str) -> None:
    make_distribution(f"deepinfer-{name}", entry_points={"deepinfer.plugins": {name: f"{name}_plugin"}},
                      modules={f"{name}_plugin": source})
    monkeypatch.setenv(plugins.ENV_PLUGINS, name)
    plugins.reset_plugin_manager()


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("enforce_eager", True)
    return LLM(str(folder), block_size=8, max_num_seqs=4, **kwargs)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [3, 9, 14, 5]}


def _tokens(llm, params=GREEDY, prompt=PROMPT) -> list[list[int]]:
    return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


def test_two_engines_keep_their_own_plugin_state(ckpt, make_distribution, monkeypatch):
    _install(make_distribution, monkeypatch, "banner", BANNER)
    plain = _llm(ckpt)
    (free,) = _tokens(plain)
    banned = _llm(ckpt, ban_id=free[0])
    assert plain.context.plugin_state == {"banner": None}
    assert banned.context.plugin_state == {"banner": free[0]}
    assert free[0] not in _tokens(banned)[0]
    assert _tokens(plain) == [free]  # the second engine's option never reached the first


class Steer(LogitsProcessor):
    """Forces ``extra_args["force"]`` on the rows that carry it; records what it saw."""

    needs_latest_tokens = True

    def __init__(self):
        self.seen = []

    def applies_to(self, params):
        return "force" in (params.extra_args or {})

    def __call__(self, logits, rows):
        self.seen.append([(row.request_id, list(row.output_token_ids), row.num_output_tokens) for row in rows])
        for i, row in enumerate(rows):
            logits[i, row.params.extra_args["force"]] += 1000.0
        return logits


@pytest.mark.parametrize("async_scheduling, graphs", [(False, False), (True, False), (True, True)])
def test_a_processor_steers_one_request_and_leaves_its_neighbour_alone(ckpt, async_scheduling, graphs):
    """Also on the static-shape decode path that device graphs replay (run eagerly on CPU with
    ``cuda_graph_sizes``): a processor sees the logits the graph wrote."""
    steer = Steer()
    static = {"enforce_eager": False, "cuda_graph_sizes": [1, 2, 4]} if graphs else {}
    llm = _llm(ckpt, logits_processors=[steer], async_scheduling=async_scheduling, **static)
    (alone,) = _tokens(llm)
    steered = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=4, ignore_eos=True, extra_args={"force": 7})
    outputs = llm.generate([PROMPT, PROMPT], [GREEDY, steered], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    assert [c.token_ids for c in outputs[1].outputs] == [[7] * 4, [7] * 4]
    ids = sorted({request_id for step in steer.seen for request_id, _, _ in step})
    assert len(ids) == 2 and all(request_id.startswith(outputs[1].request_id) for request_id in ids)
    # needs_latest_tokens: the ids so far are complete even when steps overlap
    assert all(len(seen) == count for step in steer.seen for _, seen, count in step)
    if graphs:
        assert llm.engine.runner.decode_graphs.num_replays > 0


def test_bad_words_are_never_completed(ckpt):
    llm = _llm(ckpt)
    (free,) = _tokens(llm)
    word = llm.get_tokenizer().decode(free[:2])
    (banned,) = _tokens(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word]))
    assert banned[:2] != free[:2]
    assert all(banned[i:i + 2] != free[:2] for i in range(len(banned) - 1))


def test_control_token_ids_outside_the_vocabulary_are_refused(ckpt):
    llm = _llm(ckpt)
    (out,) = llm.generate([PROMPT], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert "logit_bias has token ids [1000000] outside the vocabulary" in out.error


def test_logits_processors_argument_is_checked(ckpt):
    with pytest.raises(EngineArgsError, match="Steer is a class; pass an instance of it"):
        _llm(ckpt, logits_processors=[Steer])
    with pytest.raises(EngineArgsError, match="is not callable"):
        _llm(ckpt, logits_processors=[3])


def test_a_hook_raising_at_run_time_names_the_plugin_the_hook_and_the_error(ckpt, make_distribution, monkeypatch):
    _install(make_distribution, monkeypatch, "fragile", AFTER_STEP_RAISES)
    llm = _llm(ckpt)
    with pytest.raises(PluginHookError) as caught:
        _tokens(llm)
    assert str(caught.value) == ("plugin 'fragile' (distribution deepinfer-fragile) failed in hook "
                                 "deepinfer_after_step: KeyError: 'no such row'")
    assert isinstance(caught.value.original, KeyError) and caught.value.__cause__ is caught.value.original


def test_strict_plugins_refuse_an_engine_while_a_plugin_failed(ckpt, make_distribution, monkeypatch):
    _install(make_distribution, monkeypatch, "broken", HEADER + "raise ImportError('needs libfoo')\n")
    monkeypatch.setenv("DEEPINFER_STRICT_PLUGINS", "1")
    with pytest.raises(StrictPluginsError, match="plugin 'broken' .*: ImportError: needs libfoo"):
        _llm(ckpt)
    monkeypatch.setenv("DEEPINFER_STRICT_PLUGINS", "0")
    assert _tokens(_llm(ckpt))


def test_generate_takes_options_refuses_unclaimed_ones_and_reports_failed_plugins(ckpt, make_distribution,
                                                                               monkeypatch, capsys):
    _install(make_distribution, monkeypatch, "banner", BANNER)
    make_distribution("deepinfer-broken", entry_points={"deepinfer.plugins": {"broken": "broken_plugin"}},
                      modules={"broken_plugin": HEADER + "raise ImportError('needs libfoo')\n"})
    monkeypatch.setenv(plugins.ENV_PLUGINS, "banner,broken")
    plugins.reset_plugin_manager()
    base = ["generate", "--model", str(ckpt), "--max-tokens", "4", "--temperature", "0", "w3 w9"]
    assert main([*base, "--json", "-v"]) == 0
    err = capsys.readouterr().err
    assert "plugin 'broken' (deepinfer-broken) failed to load and is left out: ImportError: needs libfoo" in err
    assert "Traceback" in err and "deepinfer generate: backend cpu (" in err
    assert main([*base, "--option", "ban_id=5", "--option", "colour=blue"]) == 2
    err = capsys.readouterr().err
    assert "unknown option(s) colour: no loaded plugin claims them (claimed options: ban_id)" in err
    assert err.count("failed to load") == 1 and "Traceback" not in err


def test_option_values_parse_as_json_else_stay_strings():
    assert parse_options(["a=1", "b=true", 'c={"x": [1]}', "d=fast", "e="]) == {
        "a": 1, "b": True, "c": {"x": [1]}, "d": "fast", "e": ""}
    for bad, message in (("noequals", "is not NAME=VALUE"), ("seed=3", "'seed' is an engine argument")):
        with pytest.raises(CommandLineOptionError, match=message):
            parse_options([bad])
    with pytest.raises(CommandLineOptionError, match="given twice"):
        parse_options(["a=1", "a=2"])


def test_an_unclaimed_option_is_refused_by_name_by_llm_too(ckpt):
    with pytest.raises(UnknownOptionError, match="unknown option\\(s\\) colour"):
        _llm(ckpt, colour="blue")


def test_a_probe_named_unlike_its_entry_point_warns(caplog, monkeypatch):
    entry = registry.BackendEntry("mydev", "mydev_probe:probe", "deepinfer-mydev", "0.1")
    probe = ProbeResult("my_device", False, "no device", "", True, "mydev")
    monkeypatch.setattr(registry, "_import", lambda path: lambda: probe)
    with caplog.at_level("WARNING", logger="deepinfer.backends"):
        assert registry.probe_backend(entry) is probe
    assert "backend entry point 'mydev' (deepinfer-mydev) has a probe that names itself 'my_device'" in caplog.text
    assert registry.name_mismatch(entry, probe) in caplog.text


def test_env_says_which_backend_and_why():
    assert "Selected backend: cpu (no accelerator backend is" in _format_env(env_report())
