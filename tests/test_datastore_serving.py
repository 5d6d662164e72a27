"""Serving from a datastore: the load options that set it (checked before any model loads), the chains it adds to
prompt lookup and to a tree drafter's lookup, and greedy output equal to plain greedy decoding with its drafts
accepted. The Datastore's drafting: tests/test_datastore.py; its sources: tests/test_datastore_sources.py."""

from __future__ import annotations


import pytest
import torch
from transformers import DynamicCache

import inference.api as api
import inference.drafters.datastore as datastore_module
from data.errors import UsageError
from inference.api import load
from inference.bench.methods import EngineRunner, Sampling
from inference.bench.run import warm_up
from inference.drafters.datastore import SMOOTHINGS, Datastore
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.drafters.registry import LoadOptions, build_training_free, resolve
from inference.drafters.with_lookup import WithLookup
from inference.engine.drafter import DecodeState
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import build_tree
from models.checkpoint import save_drafter
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model
from tests.test_datastore_sources import chat, sharegpt_file
from tests.test_draft_model import left_pad
from tests.test_generate import random_heads
from tests.test_lookahead import repetitive_prompts

pytestmark = pytest.mark.usefixtures("single_thread")


def state_of(contexts: list[list[int]]) -> DecodeState:
    """The state after the prefill: each context's last token is the root, committed after its prompt."""
    ids = torch.tensor([c[:-1] for c in contexts])
    return DecodeState(cache=DynamicCache(), valid=ids > 0, next_pos=(ids > 0).sum(-1),
                       root=torch.tensor([c[-1] for c in contexts]), hidden=None, prompt=ids,
                       generated=[[c[-1]] for c in contexts])


def test_prompt_lookup_adds_the_datastore_tree_within_its_nodes():
    store = Datastore([[7, 8, 9, 10, 11]], request_weight=0)  # the corpus's counts alone
    # row 0: its own text has "1 2" -> 5 6, the datastore "1 2" never, "2" never: its own chain only;
    # row 1: no earlier occurrence of its last token 7 in its own text: the datastore's 8 9 10 11
    drafter = PromptLookupDrafter(num_draft=4, datastore=store)
    state = state_of([[1, 2, 5, 6, 1, 2], [3, 3, 4, 4, 4, 7]])
    assert drafter.sources(state)[1] == [[(8,), (8, 9), (8, 9, 10), (8, 9, 10, 11)]]
    assert drafter.sources(state)[0] == [[(5,), (5, 6), (5, 6, 1), (5, 6, 1, 2)]]
    # with the request's own counts (the default weight), row 0's tree drafts from its own text as well: "2" -> 5
    own = PromptLookupDrafter(num_draft=4, datastore=store.configured(request_weight=100))
    chain = [(5,), (5, 6), (5, 6, 1), (5, 6, 1, 2)]
    fresh = state_of([[1, 2, 5, 6, 1, 2], [3, 3, 4, 4, 4, 7]])  # a new generation: the run's state starts again
    assert own.sources(fresh) == [[chain, chain], [[(8,), (8, 9), (8, 9, 10), (8, 9, 10, 11)]]]
    # a row with both: the two share their first token 5 and take turns below it, a node at a time
    both = PromptLookupDrafter(num_draft=3, datastore=Datastore([[2, 5, 9, 9]], request_weight=0))
    found = both.sources(state_of([[1, 2, 5, 6, 1, 2]]))[0]
    assert found == [[(5,), (5, 6), (5, 6, 1)], [(5,), (5, 9), (5, 9, 9)]]
    draft = both.propose(state_of([[1, 2, 5, 6, 1, 2]]))
    assert draft.tree.choices == ((0,), (0, 0), (0, 1))  # 3 nodes: 5, then 6 and 9 below it; the cap cuts 1 and 9
    assert draft.tokens.tolist() == [[2, 5, 6, 9]]
    draft = both.propose(state_of([[1, 3, 5, 6, 4, 2]]))  # no earlier 2 in its own text: the datastore's tree
    assert draft.tokens.tolist() == [[2, 5, 9, 9]]


def test_prompt_lookup_drafts_only_where_the_datastore_expects_enough_accepted():
    """min_expected: a row drafts when the sum of its nodes' scores reaches it; a chain node is scored by the
    datastore's probabilities along its path, a node both sources draft by the larger score."""
    store = Datastore([[7, 8, 9]] * 3 + [[7, 8, 5]], smoothing="longest", request_weight=0)
    # no earlier 7 in the row's own text: the datastore's tree alone, "7" -> 8 (1), "7 8" -> 9 (3/4), 5 (1/4)
    row = [[3, 3, 4, 4, 4, 7]]
    for threshold, drafts in ((0.0, True), (2.0, True), (2.01, False)):
        drafter = PromptLookupDrafter(num_draft=3, datastore=store, min_expected=threshold)
        assert drafter.sources(state_of(row)) == ([[[(8,), (8, 9), (8, 5)]]] if drafts else [[]]), threshold
    # the chain 5 6 1 and the tree 5 9 9 share 5 (score 1 in both); the 3 nodes taken are 5, 6 (the chain's: 0, as
    # "2 5" is followed by 9 alone) and 9 (1): 2 expected
    both = Datastore([[2, 5, 9, 9]], smoothing="longest", request_weight=0)
    row = [[1, 2, 5, 6, 1, 2]]
    assert PromptLookupDrafter(num_draft=3, datastore=both, min_expected=2.0).sources(state_of(row)) == \
        [[[(5,), (5, 6), (5, 6, 1)], [(5,), (5, 9), (5, 9, 9)]]]
    gated = PromptLookupDrafter(num_draft=3, datastore=both, min_expected=2.5)
    assert gated.sources(state_of(row)) == [[]]
    draft = gated.propose(state_of(row + [[3, 3, 4, 4, 4, 7]]))  # the other row drafts nothing either: root only
    assert draft.tree.num_nodes == 1 and draft.tokens.tolist() == [[2], [7]]
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="prompt_lookup: min_expected must be a number >= 0"):
            PromptLookupDrafter(datastore=store, min_expected=bad)
    with pytest.raises(ValueError, match="prompt_lookup: min_expected needs a datastore"):
        PromptLookupDrafter(min_expected=1.0)
    assert PromptLookupDrafter(min_expected=0.0).min_expected == 0.0


def test_node_cost_drafts_the_best_scored_nodes_that_pay():
    """node_cost: a row's nodes (the chain's and the tree's, a node both draft scored by the larger) ranked by score,
    parents first, cut to the k maximising (1 + their scores' sum) / (1 + node_cost * k); k = 0 drafts nothing."""
    store = Datastore([[7, 8, 9]] * 3 + [[7, 8, 5]], smoothing="longest", request_weight=0)
    # the datastore's tree alone: 8 (score 1), 8 9 (3/4), 8 5 (1/4)
    row = [[3, 3, 4, 4, 4, 7]]
    # cost 0.3: 2 / 1.3, 2.75 / 1.6, 3 / 1.9 -> 2 nodes; 0.6: 2 / 1.6 = 2.75 / 2.2 -> 1 (ties keep fewer); 1: 2 / 2
    # is no gain over a plain step -> none
    for cost, nodes in ((0.01, [(8,), (8, 9), (8, 5)]), (0.3, [(8,), (8, 9)]), (0.6, [(8,)]), (1.0, None)):
        drafter = PromptLookupDrafter(num_draft=3, datastore=store, node_cost=cost)
        assert drafter.sources(state_of(row)) == ([[nodes]] if nodes else [[]]), cost
    # the chain 5 6 1 (5 scores 1, 6 scores 0: "2 5" is followed by 9 alone) and the tree 5 9 9 9 (1 each): 5 once,
    # then the tree's path, the chain's 6 ranked last and cut by num_draft
    both = Datastore([[2, 5, 9, 9]], smoothing="longest", request_weight=0)
    row = [[1, 2, 5, 6, 1, 2]]
    sized = PromptLookupDrafter(num_draft=4, datastore=both, node_cost=0.01)
    assert sized.sources(state_of(row)) == [[[(5,), (5, 9), (5, 9, 9), (5, 9, 9, 9)]]]
    draft = PromptLookupDrafter(num_draft=4, datastore=both, node_cost=2.0).propose(state_of(row))
    assert draft.tree.num_nodes == 1  # nothing pays at 2 plain steps a node: a plain step
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="prompt_lookup: node_cost must be a number >= 0"):
            PromptLookupDrafter(datastore=store, node_cost=bad)
    with pytest.raises(ValueError, match="prompt_lookup: node_cost needs a datastore"):
        PromptLookupDrafter(node_cost=0.1)
    with pytest.raises(ValueError, match="min_expected and node_cost both decide"):
        PromptLookupDrafter(datastore=store, node_cost=0.1, min_expected=1.0)


def test_min_expected_is_checked_with_the_load_options_before_the_model_loads(tmp_path, monkeypatch):
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there!")])
    request = resolve("prompt_lookup:min_expected=1.5", base=str(target))
    request.check(LoadOptions(datastore=source))  # an empty datastore stands in for the one read at load
    request.check(LoadOptions(datastore_grow=100))
    with pytest.raises(ValueError, match="^prompt_lookup: min_expected needs a datastore"):
        request.check(LoadOptions())
    engine = load("prompt_lookup:min_expected=1.5", base=str(target), dtype="fp32", datastore=source)
    assert engine.drafter.min_expected == 1.5 and engine.drafter.datastore.num_documents == 1
    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="^prompt_lookup: min_expected needs a datastore"):
        load("prompt_lookup:min_expected=1.5", base=str(target), dtype="fp32")


def test_a_datastore_is_a_load_option_never_a_spec_option(tmp_path):
    with pytest.raises(UsageError, match="prompt_lookup: unknown option 'datastore'"):
        build_training_free("prompt_lookup", {"datastore": "x"})
    source = sharegpt_file(tmp_path, [chat("hi", "hello")])
    with pytest.raises(UsageError, match="datastore= does not apply to drafter 'lookahead'; it applies to eagle3, "
                                         "medusa, prompt_lookup"):
        resolve("lookahead", base="builtin:tiny").check(LoadOptions(datastore=source))
    with pytest.raises(UsageError, match="datastore=.*nope: no such file or folder"):
        resolve("prompt_lookup", base="builtin:tiny").check(LoadOptions(datastore=str(tmp_path / "nope")))


def test_greedy_equals_plain_greedy_with_the_datastores_drafts_accepted(tiny_lm):
    """Batched, left-padded, fp32: prompt lookup alone, with a datastore of the target's own answers to other
    prompts, and Medusa with both grafted on give plain greedy decoding; the datastore raises tokens per step."""
    prompts, others = repetitive_prompts(11, 3), repetitive_prompts(12, 6)
    ids, mask = left_pad(prompts)
    config = DecodeConfig(max_new_tokens=20)
    plain = generate(tiny_lm, ids, None, config, attention_mask=mask).sequences
    other_ids, other_mask = left_pad(others)
    answers = generate(tiny_lm, other_ids, None, config, attention_mask=other_mask).sequences
    store = Datastore(answers + plain[:1])  # the target's answers, one of them to a prompt decoded below
    alone = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6), config, attention_mask=mask)
    with_store = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store), config,
                          attention_mask=mask)
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)
    grafted = generate(tiny_lm, ids, WithLookup(MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree), num_draft=6,
                                                datastore=store), config, attention_mask=mask)
    assert alone.sequences == plain and with_store.sequences == plain and grafted.sequences == plain
    assert with_store.stats.mean_accepted > alone.stats.mean_accepted + 0.2, (alone.stats.mean_accepted,
                                                                             with_store.stats.mean_accepted)
    gated = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, min_expected=1.0), config,
                     attention_mask=mask)
    never = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, min_expected=1e9), config,
                     attention_mask=mask)
    sized = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, node_cost=0.1), config,
                     attention_mask=mask)
    assert gated.sequences == plain and never.sequences == plain and sized.sequences == plain
    assert never.stats.mean_accepted == 0 and never.stats.steps == max(map(len, plain)) - 1  # a token a step
    own = store.configured(request_weight=10)  # each row's own text in the counts: rows draft differently
    for drafter in (PromptLookupDrafter(num_draft=6, datastore=own),
                    WithLookup(MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree), num_draft=6, datastore=own)):
        assert generate(tiny_lm, ids, drafter, config, attention_mask=mask).sequences == plain


def test_load_reads_the_datastore_before_the_model_and_decodes_exactly(tmp_path, monkeypatch):
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    tokenizer = tiny_tokenizer()
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there! Have a nice day.")])
    engine = load("prompt_lookup", base=str(target), dtype="fp32", datastore=source)
    assert isinstance(engine.drafter.datastore, Datastore) and engine.drafter.datastore.num_documents == 1
    prompt = tokenizer("hello world, hello", add_special_tokens=False)["input_ids"]
    plain = load(None, base=str(target), dtype="fp32").generate(prompt, max_new_tokens=12).sequences
    assert engine.generate(prompt, max_new_tokens=12).sequences == plain
    bad = sharegpt_file(tmp_path, [chat("hi", "hello"), "[1, 2"], name="bad.jsonl")
    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UsageError, match=r"^datastore=.*bad\.jsonl:2: "):
        load("prompt_lookup", base=str(target), dtype="fp32", datastore=bad)


def test_a_growing_datastore_drafts_from_earlier_answers_and_decodes_exactly(tmp_path):
    """load(..., datastore_grow=N): each generation's answers join the datastore when it ends, so asking again
    accepts more a step; every answer is plain greedy decoding (batched, left-padded, prompt lookup alone and Medusa
    with the lookup grafted on); a bench warm-up's answers are forgotten."""
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    prompts = repetitive_prompts(13, 3)
    plain = [load(None, base=str(target), dtype="fp32").generate_ids(p, max_new_tokens=24).sequences[0]
             for p in prompts]
    engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000)
    store = engine.drafter.datastore
    assert store.grows and store.num_tokens == 0
    first = engine.generate_ids(prompts[0], max_new_tokens=24)
    assert store.num_served == 1 and store.num_tokens == 24
    again = engine.generate_ids(prompts[0], max_new_tokens=24)
    assert first.sequences[0] == again.sequences[0] == plain[0]
    assert again.stats.target_forwards < first.stats.target_forwards
    batch = engine.generate_ids(prompts, max_new_tokens=24)
    assert batch.sequences == plain and store.num_served == 5
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=engine.model.vocab_size))
    heads.init_from_base(engine.model.lm_head)
    save_drafter(tmp_path / "heads", heads, str(target))
    grafted = load(str(tmp_path / "heads"), base=str(target), dtype="fp32", lookup=4, datastore_grow=10_000)
    assert [grafted.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert grafted.drafter.datastore.num_served == 6
    warm_up("prompt lookup", lambda: engine.generate_ids(prompts[1], max_new_tokens=8),
            EngineRunner(engine, Sampling(0.0, None, None, "exact")))
    assert store.num_served == 0 and store.num_tokens == 0
    request = resolve("prompt_lookup", base=str(target))
    with pytest.raises(UsageError, match="^datastore_grow applies to a datastore source"):
        request.check(LoadOptions(datastore=Datastore([[1, 2]]), datastore_grow=100))
    for bad in (0, True, 2.5):
        with pytest.raises(UsageError, match=r"^datastore_grow= must be a whole number of tokens >= 1"):
            request.check(LoadOptions(datastore_grow=bad))
    with pytest.raises(UsageError, match=r"^datastore_grow= does not apply to drafter 'jacobi'; it applies to eagle3, "
                                         r"medusa, prompt_lookup"):
        resolve("jacobi", base=str(target)).check(LoadOptions(datastore_grow=100))


def test_the_datastore_smoothing_is_a_load_option_checked_first(tmp_path):
    """load(..., datastore_smoothing=...) builds the datastore with it, and decoding stays plain greedy decoding;
    a bad value, one without a datastore and one beside a Datastore object are refused in one line."""
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    prompts = repetitive_prompts(13, 2)
    plain = [load(None, base=str(target), dtype="fp32").generate_ids(p, max_new_tokens=24).sequences[0]
             for p in prompts]
    for smoothing in SMOOTHINGS:
        engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000,
                      datastore_smoothing=smoothing)
        assert engine.drafter.datastore.smoothing == smoothing
        assert [engine.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert load("prompt_lookup", base=str(target), dtype="fp32", datastore_grow=10).drafter.datastore.smoothing == \
        "witten_bell"
    engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000,
                  datastore_request_weight=25)
    assert engine.drafter.datastore.request_weight == 25.0
    assert [engine.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert load("prompt_lookup", base=str(target), dtype="fp32", datastore_grow=10).drafter.datastore.request_weight \
        == datastore_module.REQUEST_WEIGHT
    request = resolve("prompt_lookup", base=str(target))
    for options, needle in [
        (LoadOptions(datastore_grow=10, datastore_smoothing="kneser_ney"),
         "^datastore_smoothing= must be one of witten_bell, longest, got 'kneser_ney'"),
        (LoadOptions(datastore_smoothing="longest"), "^datastore_smoothing applies with datastore or datastore_grow"),
        (LoadOptions(datastore=Datastore([[1, 2]]), datastore_smoothing="longest"),
         "^datastore_smoothing applies to a datastore source"),
        *((LoadOptions(datastore_grow=10, datastore_request_weight=bad),
           r"^datastore_request_weight= must be a number >= 0 \(how many times the request's own text counts\), got ")
          for bad in (-1, float("nan"), float("inf"), "3", True)),
        (LoadOptions(datastore_request_weight=3), "^datastore_request_weight applies with datastore or datastore_grow"),
        (LoadOptions(datastore=Datastore([[1, 2]]), datastore_request_weight=3),
         "^datastore_request_weight applies to a datastore source"),
    ]:
        with pytest.raises(UsageError, match=needle):
            request.check(options)
    with pytest.raises(UsageError, match=r"^datastore_smoothing= does not apply to drafter 'jacobi'"):
        resolve("jacobi", base=str(target)).check(LoadOptions(datastore_smoothing="longest"))
