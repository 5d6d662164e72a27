"""A tree drafter's tree with a prompt-lookup chain grafted on (inference.drafters.with_lookup): the merged tree's
shape and tokens, greedy output equal to plain greedy with the chain's nodes accepted, and loading through `load`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from data.errors import UsageError
from inference.api import load
from inference.drafters.datastore import Datastore
from inference.drafters.eagle3 import Eagle3Drafter
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.registry import LoadOptions, resolve
from inference.drafters.with_lookup import WithLookup, node_paths
from inference.engine.drafter import DecodeState, Draft
from inference.engine.loop import DecodeConfig, drafter_modules, generate
from inference.engine.tree import build_tree
from models.eagle3 import save_eagle3
from tests.conftest import build_tiny_lm
from tests.test_draft_model import left_pad
from tests.test_eagle3 import random_draft
from tests.test_generate import random_heads
from tests.test_lookahead import repetitive_prompts

pytestmark = pytest.mark.usefixtures("single_thread")

# root r; (0,) = a, (1,) = b, (0, 0) = c: a tree an inner drafter proposes
INNER = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)


class FixedDrafter:
    """Proposes INNER with fixed per-row tokens; records what `update` saw."""

    needs_hidden = False

    def __init__(self, tokens: list[list[int]], probs: torch.Tensor | None = None) -> None:
        self.tokens, self.probs, self.updates = torch.tensor(tokens), probs, 0

    def propose(self, state: DecodeState) -> Draft:
        state.drafter_state = "inner state"  # its own state survives beside the lookup's
        return Draft(tree=INNER, tokens=self.tokens, probs=self.probs)

    def update(self, state, draft, result) -> None:
        assert state.drafter_state == "inner state"
        self.updates += 1


def state_of(prompts: list[list[int]], roots: list[int]) -> DecodeState:
    ids = torch.tensor(prompts)
    return DecodeState(cache=DynamicCache(), valid=ids > 0, next_pos=(ids > 0).sum(-1), root=torch.tensor(roots),
                       hidden=None, prompt=ids, generated=[[r] for r in roots])


def test_node_paths_follow_the_parents():
    draft = Draft(tree=INNER, tokens=torch.tensor([[9, 5, 6, 7]]))
    assert INNER.choices == ((0,), (1,), (0, 0))
    assert node_paths(draft) == [[[5], [6], [5, 7]]]


def test_a_chain_continues_below_the_inner_nodes_it_repeats_and_rows_share_one_shape():
    # row 0: the context ends with 1, 2 and "1 2" was followed by 5 7 8: the chain repeats the inner nodes a (5) and
    # c (7) and adds 8 below c; row 1: "3 4" was followed by 11 12 13, none of it drafted: a new child of the root and
    # its chain. The union may add num_draft nodes to the inner tree, the rows taking turns: 13 does not fit
    inner = FixedDrafter([[2, 5, 6, 7], [4, 20, 21, 22]])
    drafter = WithLookup(inner, num_draft=3, max_ngram=2)
    state = state_of([[1, 2, 5, 7, 8, 1], [3, 4, 11, 12, 13, 3]], roots=[2, 4])
    draft = drafter.propose(state)
    assert draft.tree.choices == ((0,), (1,), (2,), (0, 0), (2, 0), (0, 0, 0))
    assert draft.tokens.tolist() == [
        [2, 5, 6, 2, 7, 2, 8],  # row 0: (2,) and (2, 0) are fillers (their parent's token)
        [4, 20, 21, 11, 22, 12, 22],  # row 1: (0, 0, 0) is a filler
    ]
    drafter.update(state, draft, result=None)  # the inner drafter sees its own state again
    assert inner.updates == 1


def test_without_a_match_the_inner_draft_is_verified_alone():
    inner = FixedDrafter([[2, 5, 6, 7]])
    drafter = WithLookup(inner, num_draft=4, min_ngram=2)
    state = state_of([[1, 3, 4, 6]], roots=[2])  # no earlier "6 2"
    draft = drafter.propose(state)
    assert draft.tree is INNER and draft.tokens.tolist() == [[2, 5, 6, 7]]


def test_the_chain_is_capped_and_sampled_inner_drafts_are_refused():
    state = state_of([[1, 2, 9, 9, 9, 9, 9, 1]], roots=[2])
    draft = WithLookup(FixedDrafter([[2, 5, 6, 7]]), num_draft=2).propose(state)
    assert draft.tree.num_nodes == INNER.num_nodes + 2  # a chain of 9 9 capped at 2 new nodes
    sampled = FixedDrafter([[2, 5, 6, 7]], probs=torch.full((1, 4, 10), 0.1))
    with pytest.raises(ValueError, match="only deterministic drafts merge"):
        WithLookup(sampled).propose(state_of([[1, 2, 9, 1]], roots=[2]))


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_greedy_equals_plain_greedy_and_chain_nodes_get_accepted(tiny_lm, kind):
    """Batched, left-padded, fp32, on prompts that repeat a pattern: the output equals plain greedy decoding, and
    with an inner drafter that rarely guesses right, the chain raises the tokens accepted per step."""
    prompts = repetitive_prompts(3, 3)
    ids, mask = left_pad(prompts)
    config = DecodeConfig(max_new_tokens=24)
    plain = generate(tiny_lm, ids, None, config, attention_mask=mask).sequences
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)

    def inner():
        if kind == "eagle3":
            return Eagle3Drafter(random_draft(), tree, tiny_lm.get_input_embeddings())
        return MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree)

    alone = generate(tiny_lm, ids, inner(), config, attention_mask=mask)
    grafted = generate(tiny_lm, ids, WithLookup(inner(), num_draft=6), config, attention_mask=mask)
    assert alone.sequences == plain and grafted.sequences == plain
    assert max(max(step) for step in grafted.stats.accepted) > tree.max_depth  # a chain node beyond the inner depth
    assert grafted.stats.mean_accepted > alone.stats.mean_accepted + 0.2, (alone.stats.mean_accepted,
                                                                           grafted.stats.mean_accepted)


def test_the_wrapped_drafters_modules_take_the_engines_kernels(tiny_lm):
    """`drafter_modules` (what `fast_linears` and `gqa_attention` route) reaches through WithLookup to the inner
    drafter's own modules: EAGLE-3's draft layer, Medusa's heads."""
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)
    eagle = Eagle3Drafter(random_draft(), tree, tiny_lm.get_input_embeddings())
    medusa = MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree)
    for inner, module in ((eagle, eagle.draft), (medusa, medusa.heads)):
        alone, wrapped = drafter_modules(inner), drafter_modules(WithLookup(inner, num_draft=4))
        assert any(m is module for m in alone)
        assert [id(m) for m in wrapped] == [id(m) for m in alone]


def test_load_grafts_the_chain_and_checks_the_option(tmp_path):
    target, path = tmp_path / "target", tmp_path / "eagle3"
    build_tiny_lm("llama").save_pretrained(target)
    save_eagle3(path, random_draft(), str(target))
    engine = load(path, dtype="fp32", lookup=5)
    assert isinstance(engine.drafter, WithLookup) and engine.drafter.lookup.num_draft == 5
    assert engine.drafter.feature_layers == engine.drafter.inner.feature_layers
    assert engine.tree is engine.drafter.inner.tree  # the drafter's own tree, as without the chain
    prompt = repetitive_prompts(5, 1)[0]
    plain = load(None, base=str(target), dtype="fp32").generate(prompt, max_new_tokens=16).sequences
    assert engine.generate(prompt, max_new_tokens=16).sequences == plain
    for bad in (0, 65, 2.5, True):
        with pytest.raises(UsageError, match=r"lookup= must be a whole number of tokens in \[1, 64\]"):
            resolve(str(path)).check(LoadOptions(lookup=bad))


# --- a node budget over both sources, ranked by score -----------------------------------------------------------------

def test_a_budget_keeps_the_likeliest_nodes_of_both_sources():
    """Row 0: the inner tree's nodes a (5) 0.5, b (6) 0.2, c (5 7) 0.3 and the lookup's 5 0.4 (the larger, the
    drafter's 0.5, counts), 5 7 0.35 (c again: 0.35 counts), 5 7 8 0.35, 9 0.25: a budget of 4 keeps a, c, 5 7 8 (a
    tie: the parent first), then 9 (0.25 beats b's 0.2). Row 1 shares the shape: its own ranking fills it in turn."""
    scores = torch.tensor([[1.0, 0.5, 0.2, 0.3], [1.0, 0.9, 0.05, 0.8]])
    inner = FixedDrafter([[2, 5, 6, 7], [4, 20, 21, 22]])
    inner.propose = lambda state, base=inner.propose: Draft(tree=INNER, tokens=base(state).tokens, scores=scores)
    drafter = WithLookup(inner, num_draft=3, datastore=Datastore([[1]]), budget=4)
    drafter.lookup.scored_nodes = lambda state: [{(5,): 0.4, (5, 7): 0.35, (5, 7, 8): 0.35, (9,): 0.25}, {}]
    draft = drafter.propose(state_of([[1, 2, 3], [3, 4, 5]], roots=[2, 4]))
    # row 0 ranks a, c, 5 7 8, 9, b; row 1 ranks 20, 22 (under 20), 21: taking turns, the union of 4 paths is (0,),
    # (0, 0), (0, 0, 0) (row 0's 8; a filler for row 1) and (1,) (row 0's 9, row 1's 21); row 0's b does not fit
    assert draft.tree.choices == ((0,), (1,), (0, 0), (0, 0, 0))
    assert draft.tokens.tolist() == [[2, 5, 9, 7, 8], [4, 20, 21, 22, 22]]
    with pytest.raises(ValueError, match="budget ranks the datastore's scores, so it needs a datastore"):
        WithLookup(inner, budget=4)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="whole number of nodes >= 1"):
            WithLookup(inner, datastore=Datastore([[1]]), budget=bad)
    unscored = WithLookup(FixedDrafter([[2, 5, 6, 7]]), datastore=Datastore([[1]]), budget=4)
    with pytest.raises(ValueError, match="the inner drafter does not score its nodes"):
        unscored.propose(state_of([[1, 2, 3]], roots=[2]))


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_budget_decodes_exactly_within_its_node_count(tiny_lm, kind):
    """Batched, left-padded, fp32, a datastore of the target's own answers: with a budget the output equals plain
    greedy decoding, no step verifies more than budget + 1 nodes, and the pool verifies more a step than the drafter's
    own tree (a random drafter's: the datastore's nodes win the budget)."""
    prompts, others = repetitive_prompts(11, 3), repetitive_prompts(12, 6)
    ids, mask = left_pad(prompts)
    config = DecodeConfig(max_new_tokens=20)
    plain = generate(tiny_lm, ids, None, config, attention_mask=mask).sequences
    other_ids, other_mask = left_pad(others)
    store = Datastore(generate(tiny_lm, other_ids, None, config, attention_mask=other_mask).sequences + plain[:1])
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)
    inner = (Eagle3Drafter(random_draft(), tree, tiny_lm.get_input_embeddings()) if kind == "eagle3"
             else MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree))
    drafter = WithLookup(inner, num_draft=6, datastore=store, budget=4)
    sizes, propose = [], drafter.propose

    def recorded(state):
        draft = propose(state)
        sizes.append(draft.tree.num_nodes)
        return draft

    drafter.propose = recorded
    out = generate(tiny_lm, ids, drafter, config, attention_mask=mask)
    alone = generate(tiny_lm, ids, inner, config, attention_mask=mask)
    assert out.sequences == plain
    assert max(sizes) <= 5 and out.stats.mean_accepted > alone.stats.mean_accepted + 0.2, (
        sizes, alone.stats.mean_accepted, out.stats.mean_accepted)


def test_load_takes_a_budget_with_lookup_and_a_datastore_and_refuses_it_otherwise(tmp_path):
    target, path = tmp_path / "target", tmp_path / "eagle3"
    build_tiny_lm("llama").save_pretrained(target)
    save_eagle3(path, random_draft(), str(target))
    request = resolve(str(path))
    request.check(LoadOptions(lookup=4, lookup_budget=8, datastore_grow=100))
    for options, needle in [
        (LoadOptions(lookup=4, lookup_budget=8), "lookup_budget needs lookup and datastore"),
        (LoadOptions(lookup_budget=8, datastore_grow=100), "lookup_budget needs lookup and datastore"),
        (LoadOptions(lookup=4, lookup_budget=0, datastore_grow=100), r"whole number of nodes in \[1, 256\]"),
        (LoadOptions(lookup=4, lookup_budget=True, datastore_grow=100), r"whole number of nodes in \[1, 256\]"),
    ]:
        with pytest.raises(UsageError, match=needle):
            request.check(options)
    with pytest.raises(UsageError, match="lookup_budget= does not apply to drafter 'prompt_lookup'"):
        resolve("prompt_lookup", base=str(target)).check(LoadOptions(lookup_budget=8, datastore_grow=100))
    engine = load(path, dtype="fp32", lookup=4, lookup_budget=6, datastore_grow=1000)
    assert engine.drafter.budget == 6
    prompt = repetitive_prompts(5, 1)[0]
    plain = load(None, base=str(target), dtype="fp32").generate(prompt, max_new_tokens=16).sequences
    assert engine.generate(prompt, max_new_tokens=16).sequences == plain
