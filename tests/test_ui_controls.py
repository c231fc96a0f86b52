"""Inputs: parameter panels from each method's Params metadata and configs/, decoding settings, examples."""

import gradio as gr
import pytest

from specgui import methods
from specgui.errors import SpecGUIError
from specgui.methods.params import specs
from specgui.ui import controls


@pytest.fixture(scope="module")
def panel():
    with gr.Blocks():
        return controls.param_panel("SmolLM2-135M-Instruct", "cpu", shown="pld")


def test_every_registered_method_gets_a_panel_from_its_params(panel):
    assert list(panel.groups) == methods.names()
    for name in methods.names():
        declared = [s["name"] for s in specs(methods.get(name).Params)]
        assert [p for m, p in panel.keys if m == name] == declared
    assert panel.groups["pld"].visible and not panel.groups["baseline"].visible


def test_widgets_follow_the_declared_ranges_and_the_presets(panel):
    widgets = {key: c for key, c in zip(panel.keys, panel.components)}
    num_draft = widgets[("pld", "num_draft")]
    assert isinstance(num_draft, gr.Slider) and (num_draft.minimum, num_draft.maximum, num_draft.step) == (1, 64, 1)
    cpu = methods.params_for("pld", "SmolLM2-135M-Instruct", "cpu").num_draft
    assert num_draft.value == cpu  # configs/pld.yaml's CPU preset
    gpu = panel.presets("SmolLM2-135M-Instruct", "cuda")
    assert gpu[panel.keys.index(("pld", "num_draft"))] == methods.params_for("pld", "x", "cuda").num_draft


def test_panel_values_become_typed_overrides_for_the_chosen_method_only(panel):
    values = [float(v) if isinstance(v, int) else v for v in panel.presets("SmolLM2", "cpu")]
    overrides = panel.overrides("pld", values)
    assert set(overrides) == {s["name"] for s in specs(methods.get("pld").Params)}
    kinds = {s["name"]: s["type"] for s in specs(methods.get("pld").Params)}
    # sliders hand back floats; Params want ints, choices stay strings
    assert all(type(v) is kinds[k] for k, v in overrides.items())
    assert panel.overrides("baseline", values) == {}
    methods.params_for("pld", "SmolLM2", "cpu", overrides)  # validates
    shown = panel.show("baseline")
    assert [u["visible"] for u in shown] == [n == "baseline" for n in panel.groups]


def test_decoding_settings():
    assert controls.sampling_from("greedy", 0.9, 0.5, 3).greedy
    sampled = controls.sampling_from("sampling", 0.7, 0.9, 5.0)
    assert (sampled.temperature, sampled.top_p, sampled.seed) == (0.7, 0.9, 5)
    assert controls.sampling_from("sampling", 0.7, 1.0, None).seed is None
    with pytest.raises(SpecGUIError, match="temperature"):
        controls.sampling_from("sampling", 0, 1.0, None)
    for seed in (1e30, -1, float("nan")):  # torch's generator takes 0..2^63 - 1
        with pytest.raises(SpecGUIError, match="seed"):
            controls.sampling_from("sampling", 0.7, 1.0, seed)
    cap = controls.max_new_tokens_cap()
    assert controls.clamp_tokens(12.0) == (12, "")
    assert controls.clamp_tokens(cap + 5)[0] == cap and "capped" in controls.clamp_tokens(cap + 5)[1]
    with pytest.raises(SpecGUIError):
        controls.clamp_tokens(0)


def test_examples_keep_their_conversation_until_edited():
    examples = controls.examples()
    multi = next(e for e in examples if e.row.messages is not None and len(e.row.messages) > 1)
    assert multi.label.startswith(f"{multi.row.category} · {multi.row.id}: ")
    assert controls.prompt_for(multi.row.preview, multi) == multi.row.messages
    edited = multi.row.preview + " Please be brief."
    assert controls.prompt_for(edited, multi) == edited
    assert controls.prompt_for("hello", None) == "hello"


def test_presets_name_a_registered_method_and_a_suite_prompt_each():
    presets = controls.presets(controls.examples())
    assert len({p.method for p in presets}) == len(presets)  # one per method
    assert set(p.method for p in presets) == set(methods.names())
    assert all(p.max_new_tokens <= controls.max_new_tokens_cap() and p.name for p in presets)
    # the layer-skip presets show the paper's schedule: on a CPU the cost model decodes them plainly
    assert {p.method for p in presets if p.params.get("policy") == "fixed"} >= {"clasp", "admg"}


def test_a_preset_sets_its_methods_parameters_over_the_configs_ones(panel):
    values = panel.presets("SmolLM2", "cpu", "clasp", {"policy": "fixed"})
    chosen = dict(zip(panel.keys, values))
    assert chosen[("clasp", "policy")] == "fixed" and chosen[("admg", "policy")] == "cost"
    plain = dict(zip(panel.keys, panel.presets("SmolLM2", "cpu")))
    assert chosen[("clasp", "skip_fraction")] == plain[("clasp", "skip_fraction")]


@pytest.mark.parametrize("text, message", [
    ("", "must hold a list of presets"),
    ("- {name: x, method: nope, prompt: qa-01, max_new_tokens: 8}", "unknown method 'nope'"),
    ("- {name: x, method: pld, prompt: qa-99, max_new_tokens: 8}", "no suite prompt with id 'qa-99'"),
    ("- {name: x, method: pld, prompt: qa-01, max_new_tokens: 0}", "max_new_tokens must be an integer"),
    ("- {name: x, method: pld}", "needs text fields name, method and prompt"),
    ("- {name: x, method: pld, prompt: qa-01, max_new_tokens: 8, params: {num_draft: 99}}", "preset 1: .*num_draft"),
    ("- {name: x, method: pld, prompt: qa-01, max_new_tokens: 8, params: [1]}", "params must be a mapping"),
])
def test_a_bad_preset_file_is_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "demos.yaml"
    path.write_text(text)
    with pytest.raises(SpecGUIError, match=message):
        controls.presets(controls.examples(), path)


def test_a_deployment_names_its_own_presets_file(tmp_path, monkeypatch):
    """SPECGUI_DEMOS: the presets of that file, in place of configs/demos.yaml (checked alike)."""
    path = tmp_path / "mine.yaml"
    path.write_text("- {name: Mine, method: pld, prompt: qa-01, max_new_tokens: 8}")
    monkeypatch.setenv(controls.DEMOS_ENV, str(path))
    assert [(p.name, p.method, p.max_new_tokens) for p in controls.presets(controls.examples())] == [("Mine", "pld", 8)]
    path.write_text("- {name: x, method: nope, prompt: qa-01, max_new_tokens: 8}")
    with pytest.raises(SpecGUIError, match=r"mine\.yaml, preset 1: unknown method 'nope'"):
        controls.presets(controls.examples())
    monkeypatch.delenv(controls.DEMOS_ENV)
    assert len(controls.presets(controls.examples())) == len(controls.presets(controls.examples(), controls.DEMOS_FILE))
