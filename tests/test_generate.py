"""The generation loop against plain decoding: greedy token for token, sampling in distribution, stop rules, API."""

from __future__ import annotations

import math
import random

import pytest
import torch

from inference.drafters.medusa import MedusaDrafter
from inference.engine.drafter import DecodeState, Draft, NoDrafter
from inference.engine.loop import DecodeConfig, generate, stop_index
from inference.engine.tree import TreeBuffers, build_tree, load_tree
from inference.engine.verify import SamplingParams, VerifyResult, target_probs
from models.medusa import MedusaConfig, MedusaHeads
from tests.test_draft_model import left_pad

pytestmark = pytest.mark.usefixtures("single_thread")
VOCAB = 128


@torch.no_grad()
def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence every step, no cache, no masks."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def random_prompts(seed: int, count: int, low: int = 2, high: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


class OracleDrafter:
    """Test drafter: knows each row's true greedy continuation and hides it among random candidates, so paths of
    every depth and rank get accepted and rejected. Candidates depend only on (head, rank), as for Medusa."""

    needs_hidden = False

    def __init__(self, tree: TreeBuffers, references: list[list[int]], hit_rate: float, seed: int) -> None:
        self.tree, self.references, self.hit_rate = tree, references, hit_rate
        self.rng = random.Random(seed)

    def propose(self, state: DecodeState) -> Draft:
        rows = []
        for row, done in enumerate(state.generated):
            table = []
            for head in range(self.tree.max_depth):
                cands = self.rng.sample(range(VOCAB), self.tree.topk)
                index = len(done) + head  # the true token `head + 1` places after the root
                truth = self.references[row][index] if index < len(self.references[row]) else None
                if truth is not None and self.rng.random() < self.hit_rate:
                    cands = [c for c in cands if c != truth][: self.tree.topk - 1]
                    cands.insert(min(int(self.rng.expovariate(1.5)), self.tree.topk - 1), truth)
                table += cands
            rows.append(table)
        table = torch.tensor(rows, dtype=torch.long).view(len(rows), -1)
        tokens = torch.cat([state.root[:, None], table[:, self.tree.candidate_index]], dim=1)
        return Draft(tree=self.tree, tokens=tokens)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Stateless."""


def random_heads(num_heads: int, model, seed: int) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads=num_heads, num_layers=1, hidden_size=32, vocab_size=VOCAB))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads.eval().requires_grad_(False)


def test_no_drafter_equals_plain_greedy(tiny_lm):
    for prompt in random_prompts(0, 3):
        out = generate(tiny_lm, torch.tensor([prompt]), NoDrafter(), DecodeConfig(max_new_tokens=12))
        assert out.sequences[0] == plain_greedy(tiny_lm, prompt, 12)
        assert out.stats.target_forwards == 12 and out.stats.mean_accepted == 0
        per_step, times = out.stats.per_step(), out.stats.times
        assert per_step.forward == pytest.approx(times.forward / 11) and times.total > 0


@pytest.mark.parametrize("tree_spec", ["default", "chain", [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]])
def test_tree_greedy_equals_plain_greedy(tiny_lm, tree_spec):
    tree = load_tree(tree_spec, num_heads=3, topk=10)
    accepted = []
    for i, prompt in enumerate(random_prompts(1, 4)):
        reference = plain_greedy(tiny_lm, prompt, 24)
        drafter = OracleDrafter(tree, [reference], hit_rate=0.8, seed=i)
        out = generate(tiny_lm, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=20))
        assert out.sequences[0] == reference[:20]
        assert out.stats.target_forwards == 1 + out.stats.steps
        assert sum(a[0] + 1 for a in out.stats.accepted) + 1 >= 20  # every step commits accepted + 1 tokens
        accepted.append(out.stats.mean_accepted)
    assert sum(accepted) / len(accepted) > 0.5  # the oracle's drafts were accepted: the test exercised acceptance


def normal_heads(shared: bool, seed: int) -> MedusaHeads:
    """3 heads of 1 block over the tiny models' hidden size, every parameter ~ N(0, 0.2²): distinct, confident picks."""
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=VOCAB, share_lm_head=shared))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


@pytest.mark.parametrize("seed", [0, 1])
def test_medusa_heads_greedy_equals_plain_greedy(tiny_lm_factory, seed):
    for arch in ("llama", "qwen2", "mistral"):
        model = tiny_lm_factory(arch, seed=seed)
        drafter = MedusaDrafter(random_heads(3, model, seed=3 + seed), load_tree(None, num_heads=3, topk=10))
        for prompt in random_prompts(2 + seed, 2):
            out = generate(model, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=10))
            assert out.sequences[0] == plain_greedy(model, prompt, 10)


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_candidates_are_the_heads_top_k(tiny_lm_factory, shared):
    """Drafting at one position equals MedusaHeads.forward there (head k at the root's parent -> depth k nodes);
    shared-lm_head heads go through the base lm_head in one call."""
    model = tiny_lm_factory("llama")
    heads = normal_heads(shared, seed=12)
    lm_head = model.get_output_embeddings()
    tree = load_tree([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2)], num_heads=3, topk=10)
    drafter = MedusaDrafter(heads, tree, lm_head if shared else None)
    hidden = torch.randn(2, 32)
    expected = heads(hidden[:, None], lm_head)[:, :, 0].topk(tree.topk, dim=-1).indices  # [H, B, R]
    assert torch.equal(drafter.candidates(hidden), expected.permute(1, 0, 2).reshape(2, -1))
    prompt = random_prompts(13, 1)[0]
    out = generate(model, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=8))
    assert out.sequences[0] == plain_greedy(model, prompt, 8)
    if not shared:
        with pytest.raises(ValueError, match="pass base_lm_head"):
            MedusaDrafter(MedusaHeads(MedusaConfig(3, 1, 32, VOCAB, share_lm_head=True)), tree)
        # Own projections run as one bmm over a stack the heads' weights are views of: same parameters, no copy.
        stacked = drafter.stacked
        assert stacked is not None
        for k, head in enumerate(heads.heads):
            assert head.lm_head.weight.data_ptr() == stacked.projection[k].data_ptr()
            assert head.blocks[0].linear.weight.data_ptr() == stacked.weights[0][k].data_ptr()
            assert head.blocks[0].linear.bias.data_ptr() == stacked.biases[0][k].data_ptr()
        heads.double()  # moved/cast after the drafter was built: the drafter re-stacks instead of using stale weights
        expected = heads(hidden[:, None].double(), lm_head)[:, :, 0].topk(tree.topk, dim=-1).indices
        assert torch.equal(drafter.candidates(hidden), expected.permute(1, 0, 2).reshape(2, -1))
        assert drafter.stacked.projection.dtype == torch.float64 and drafter.stacked.weights[0].dtype == torch.float64


def test_medusa_scores_a_path_by_its_heads_probabilities(tiny_lm):
    """Draft.scores of Medusa: each node's head probability of its candidate, multiplied along the path."""
    heads = random_heads(2, tiny_lm, seed=5)
    tree = build_tree([(0,), (1,), (0, 0), (1, 1)], num_heads=2, topk=2)
    drafter = MedusaDrafter(heads, tree)
    hidden = torch.randn(2, 32)
    probs = heads(hidden[:, None].float())[:, :, 0].softmax(-1)  # [H, B, V]
    ids, logp = drafter.scored_candidates(hidden)
    assert torch.equal(ids, drafter.candidates(hidden))
    table = ids.view(2, 2, tree.topk)  # [B, H, R]
    p = lambda b, head, rank: probs[head, b, table[b, head, rank]].item()  # noqa: E731
    scores = drafter.path_scores(logp)
    for b in range(2):
        expected = [1.0, p(b, 0, 0), p(b, 0, 1), p(b, 0, 0) * p(b, 1, 0), p(b, 0, 1) * p(b, 1, 1)]
        assert scores[b].tolist() == pytest.approx(expected, rel=1e-5)


def test_batched_left_padded_greedy_equals_per_row(tiny_lm):
    prompts = random_prompts(4, 5, low=1, high=9)
    references = [plain_greedy(tiny_lm, p, 18) for p in prompts]
    ids, mask = left_pad(prompts)
    tree = load_tree(None, num_heads=3, topk=10)
    for drafter in (OracleDrafter(tree, references, hit_rate=0.7, seed=5), NoDrafter()):
        out = generate(tiny_lm, ids, drafter, DecodeConfig(max_new_tokens=14), attention_mask=mask)
        assert out.sequences == [r[:14] for r in references]
    per_row = list(zip(*generate(tiny_lm, ids, OracleDrafter(tree, references, 0.7, 6), DecodeConfig(max_new_tokens=14),
                                 attention_mask=mask).stats.accepted))
    assert len(set(per_row)) > 1  # rows accepted different lengths: the cache had holes


def test_stop_conditions_and_streaming(tiny_lm_factory):
    model = tiny_lm_factory("llama")
    prompt = random_prompts(7, 1)[0]
    reference = plain_greedy(model, prompt, 30)
    tree = load_tree("chain", num_heads=4, topk=1)
    run = lambda config, **kw: generate(  # noqa: E731
        model, torch.tensor([prompt]), OracleDrafter(tree, [reference], 0.9, 8), config, **kw
    ).sequences[0]

    assert run(DecodeConfig(max_new_tokens=7)) == reference[:7]
    eos = reference[9]
    assert run(DecodeConfig(max_new_tokens=30, eos_token_ids=(eos,))) == reference[: reference.index(eos) + 1]
    stop = tuple(reference[5:7])
    expected = next(i + 2 for i in range(30) if tuple(reference[i : i + 2]) == stop)
    assert run(DecodeConfig(max_new_tokens=30, stop_sequences=(stop,))) == reference[:expected]

    chunks: list[list[int]] = []
    out = run(DecodeConfig(max_new_tokens=25), stream=lambda row, toks: chunks.append(list(toks)))
    assert sum(chunks, []) == out == reference[:25]
    assert len(chunks) < 25  # several tokens per step reach the stream together


def test_stop_index_rules():
    config = DecodeConfig(max_new_tokens=6, eos_token_ids=(9,), stop_sequences=((4, 5),))
    assert stop_index([1, 2, 3], 0, config) is None
    assert stop_index([1, 9, 3], 0, config) == 2
    assert stop_index([1, 4, 5, 9], 0, config) == 3
    assert stop_index([1, 2, 3, 4, 5, 6, 7, 8], 3, config) == 5
    assert stop_index([1, 2, 3, 4, 7, 6, 7, 8], 3, config) == 6
    with pytest.raises(ValueError, match="acceptance"):
        DecodeConfig(acceptance="lossy")


def test_sliding_window_limit_is_enforced(tiny_lm_factory):
    model = tiny_lm_factory("mistral")  # sliding_window=256 in the fixture
    with pytest.raises(ValueError, match="sliding_window=256"):
        generate(model, torch.tensor([[5, 6, 7]]), config=DecodeConfig(max_new_tokens=300))


def test_typical_acceptance_runs_and_seeds_reproduce(tiny_lm_factory):
    model = tiny_lm_factory("qwen2")
    drafter = MedusaDrafter(random_heads(2, model, seed=9), load_tree(None, num_heads=2, topk=10))
    prompt = torch.tensor([random_prompts(10, 1)[0]])
    for acceptance in ("typical", "exact"):
        config = DecodeConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.8), acceptance=acceptance)
        first = generate(model, prompt, drafter, config, generator=torch.Generator().manual_seed(3))
        again = generate(model, prompt, drafter, config, generator=torch.Generator().manual_seed(3))
        assert first.sequences == again.sequences and len(first.sequences[0]) == 12


class TableDrafter:
    """Test drafter for the sampling test: proposes the target's own top-R continuations, read from exact tables
    of the processed target distribution (P2[x1], P3[x1, x2]), so sampled paths are often accepted."""

    needs_hidden = False

    def __init__(self, tree: TreeBuffers, p2: torch.Tensor, p3: torch.Tensor) -> None:
        self.tree = tree
        self.top2 = p2.topk(tree.topk, dim=-1).indices  # [V, R]
        self.top3 = p3.topk(tree.topk, dim=-1).indices  # [V, V, R]

    def propose(self, state: DecodeState) -> Draft:
        first = torch.tensor([g[0] for g in state.generated])
        second = torch.tensor([g[1] if len(g) > 1 else 0 for g in state.generated])
        tokens = torch.empty(len(first), self.tree.num_nodes, dtype=torch.long)
        tokens[:, 0] = state.root
        for node in range(1, self.tree.num_nodes):
            rank, parent = int(self.tree.rank[node]), int(self.tree.parent[node])
            one = torch.tensor([len(g) == 1 for g in state.generated])
            if self.tree.depth[node] == 1:  # continuation of the root
                tokens[:, node] = torch.where(one, self.top2[first, rank], self.top3[first, second, rank])
            else:  # depth 2: continuation of (x1, parent token); deeper drafts do not affect the test
                tokens[:, node] = self.top3[first, tokens[:, parent], rank]
        return Draft(tree=self.tree, tokens=tokens)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Stateless."""


def binned_chi_square(observed: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """Pearson statistic with cells of expected count < 5 merged into one; critical value at alpha = 1e-3
    (Wilson-Hilferty, z = 3.09). Returns (statistic, critical)."""
    expected = probs.reshape(-1).double() * n
    observed = observed.reshape(-1).double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = ((o - e) ** 2 / e.clamp(min=1e-12)).sum().item()
    df = len(e) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_with_drafts_matches_the_target_distribution(tiny_lm_factory):
    """10k sampled continuations through the speculative loop (batched, per-row acceptance) against the exact
    joint laws of (x1, x2) and (x2, x3) computed by brute force from the target."""
    model = tiny_lm_factory("llama")
    params = SamplingParams(temperature=0.6, top_k=40)
    prompt = [17, 90, 33]
    with torch.no_grad():
        p1 = target_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], params)  # [V]
        ctx2 = torch.cat([torch.tensor(prompt).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = target_probs(model(input_ids=ctx2).logits[:, -1], params)  # [V, V]
        ctx3 = torch.cat([ctx2.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
        p3 = target_probs(model(input_ids=ctx3).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], num_heads=2, topk=3)
    n = 10_000
    out = generate(
        model, torch.tensor([prompt] * n), TableDrafter(tree, p2, p3),
        DecodeConfig(max_new_tokens=3, sampling=params), generator=torch.Generator().manual_seed(0),
    )
    x = torch.tensor(out.sequences)  # [n, 3]
    assert out.stats.mean_accepted > 0.5
    joint12 = p1[:, None] * p2  # [V, V]
    joint23 = (joint12[:, :, None] * p3).sum(0)  # [V, V]
    for (a, b), joint in (((0, 1), joint12), ((1, 2), joint23)):
        observed = torch.bincount(x[:, a] * VOCAB + x[:, b], minlength=VOCAB * VOCAB)
        stat, critical = binned_chi_square(observed, joint, n)
        assert stat < critical, f"tokens {a},{b}: chi-square {stat:.1f} >= {critical:.1f}"


def test_api_load_serves_a_saved_checkpoint(tmp_path, tiny_lm_factory):
    import json

    from inference.api import load
    from models.checkpoint import CheckpointError, save_drafter

    model = tiny_lm_factory("qwen2")
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    heads = random_heads(2, model, seed=11)
    ckpt = save_drafter(tmp_path / "drafter", heads, base_model_name_or_path=str(base_dir))

    engine = load(ckpt, dtype="fp32", tree="chain")  # base read from the checkpoint's config.json
    assert engine.tree.num_nodes == 3 and engine.drafter_config["drafter_type"] == "medusa"
    prompts = random_prompts(12, 2)
    out = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)  # ragged lists: left-padded inside
    assert out.sequences == [plain_greedy(model, p, 8) for p in prompts]
    single = engine.generate(torch.tensor(prompts[0]), max_new_tokens=8, ignore_eos=True)
    assert single.sequences[0] == out.sequences[0]
    baseline = load(base=str(base_dir), dtype="fp32")
    assert baseline.generate(prompts[1], max_new_tokens=8, ignore_eos=True).sequences[0] == out.sequences[1]

    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "drafter_type": "jacobi-x"}))
    with pytest.raises(CheckpointError, match=r"config\.json: drafter_type 'jacobi-x' is not served"):
        load(ckpt, dtype="fp32")
    (ckpt / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": ""}))
    with pytest.raises(CheckpointError, match="no base_model_name_or_path"):
        load(ckpt, dtype="fp32")
    with pytest.raises(ValueError, match=r"tree= does not apply to plain decoding \(no drafter\)"):
        load(base=str(base_dir), tree="chain")


@pytest.mark.parametrize("shared", [False, True])
def test_head_vocabulary_shortlist_is_lossless(tiny_lm_factory, shared):
    """A shortlist [S] restricts candidates to its ids and equals the heads' own top-k over those columns; the full
    vocabulary (any order) gives the unrestricted candidates; decoding stays equal to plain greedy (batched)."""
    model = tiny_lm_factory("llama")
    heads = normal_heads(shared, seed=21)
    lm_head = model.get_output_embeddings()
    tree = load_tree(None, num_heads=3, topk=10)
    base = lm_head if shared else None
    hidden = torch.randn(2, 32)
    full = MedusaDrafter(heads, tree, base).candidates(hidden)
    everything = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(MedusaDrafter(heads, tree, base, everything).candidates(hidden), full)
    vocab = everything[: VOCAB // 3]
    short = MedusaDrafter(heads, tree, base, vocab)
    got = short.candidates(hidden).view(2, 3, tree.topk)  # [B, H, R]
    logits = heads(hidden[:, None], lm_head)[:, :, 0][..., vocab]  # [H, B, S]
    want = vocab[logits.topk(tree.topk, dim=-1).indices].permute(1, 0, 2)
    assert torch.equal(got, want)
    assert torch.isin(got, vocab).all()
    prompts = random_prompts(31, 3)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = generate(model, ids, short, DecodeConfig(max_new_tokens=12), attention_mask=mask)
    assert out.sequences == [plain_greedy(model, p, 12) for p in prompts]
    with pytest.raises(ValueError, match="top-k <= S"):
        MedusaDrafter(heads, tree, base, vocab[:5])
    with pytest.raises(ValueError, match="distinct"):
        MedusaDrafter(heads, tree, base, torch.cat([vocab, vocab[:1]]))


def test_phase_timers_synchronise_cuda_at_both_ends(tiny_lm_factory, monkeypatch):
    """On CUDA, kernels run after their launch returns: every timed phase must wait for the device at its start and
    end, or the forward is billed to verify (DecodeConfig.sync_phases, which benchmarks set). A stand-in for the CUDA sync counts the calls (CPU has nothing to wait
    for, so the real helper returns None there)."""
    import importlib

    from inference.engine.devices import cuda_sync

    loop = importlib.import_module("inference.engine.loop")

    model = tiny_lm_factory("llama")
    assert cuda_sync(model) is None
    calls = []
    monkeypatch.setattr(loop, "cuda_sync", lambda m: (lambda: calls.append(1)))
    generate(model, torch.tensor([[5, 6, 7]]), NoDrafter(), DecodeConfig(max_new_tokens=6))
    assert calls == []  # opt-in: a plain generation does not wait on the device between phases
    out = generate(model, torch.tensor([[5, 6, 7]]), NoDrafter(), DecodeConfig(max_new_tokens=6, sync_phases=True))
    phases_per_step = 5  # draft, forward, verify, cache, drafter update
    assert out.stats.steps > 0
    assert len(calls) == 2 * (1 + phases_per_step * out.stats.steps)


def test_slot_cache_decodes_as_the_stock_cache(tiny_lm, monkeypatch):
    """The engine's slot cache against stock DynamicCache concatenation: the same tokens and acceptance, batched and
    left-padded with a tree drafter, with the reserve cut to nothing so that the buffers regrow mid-generation."""
    import inference.engine.loop as loop  # deferred: the module whose constant this test patches

    monkeypatch.setattr(loop, "TREE_SLOTS", 0)
    prompts = random_prompts(7, 3, low=2, high=8)
    references = [plain_greedy(tiny_lm, p, 30) for p in prompts]
    ids, mask = left_pad(prompts)
    tree = load_tree(None, num_heads=3, topk=10)
    runs = [generate(tiny_lm, ids, OracleDrafter(tree, references, 0.7, seed=3),
                     DecodeConfig(max_new_tokens=24, slot_cache=slots), attention_mask=mask) for slots in (True, False)]
    assert runs[0].sequences == runs[1].sequences == [r[:24] for r in references]
    assert runs[0].stats.accepted == runs[1].stats.accepted
