"""The options a drafter is loaded with, declared once: `LoadOptions`, a field each, whose `Option` (inference.engine.
options) gives its help, its command-line flag, what a valid value is and which drafter types take it.

inference.load takes each as a keyword of its field's name (`lookup_budget=8`), the command line as a flag
(`--lookup-budget 8`), a bench plan's `args` as that flag; `check_options` refuses, in one line naming the argument
the caller's way, an option the drafter's type does not take, a value its `valid` rejects, and a combination that
cannot work, before any model loads. inference.drafters.registry builds the drafter from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from data.errors import UsageError
from inference.drafters.datastore import (
    REQUEST_WEIGHT, SMOOTHINGS, Datastore, check_spec, load_datastore,
)
from inference.engine.options import API, Naming, check, number, option, options_of, whole

MEDUSA_TOPK = 10  # candidates kept per head: the largest rank a tree may use is MEDUSA_TOPK - 1
MAX_LOOKUP = 64  # the longest prompt-lookup chain `lookup` grafts onto a tree
MAX_BUDGET = 256  # the most nodes `lookup_budget` keeps of the pooled tree (the dynamic tree's limit too)
TREE_DRAFTERS = ("eagle3", "medusa")  # drafters whose trees `lookup` grafts a chain onto
DATASTORE_DRAFTERS = (*TREE_DRAFTERS, "prompt_lookup")  # drafters that draft from a datastore
STORE = ("datastore", "datastore_grow")  # the options that make a datastore (a source, or one grown while serving)


@dataclass(frozen=True)
class LoadOptions:
    """What `load` passes every builder; `check_options` has refused the ones the type does not take."""

    tree: Any = option(
        drafters=("draft_model", "eagle3", "medusa"),
        help="draft tree: default | chain | chain:<depth> | tree.json (from build-tree); EAGLE-3 also default:<nodes> "
             "(its acceptance's tree of that size) and dynamic[:<nodes>[:<depth>[:<topk>]]] (EAGLE-2's tree, grown "
             "each step from the draft's confidence); draft models chain:<n> and branches:<k>x<n>; a list of paths "
             "in the Python API (inference.engine.tree.load_tree)")
    topk: int = option(MEDUSA_TOPK, cli=False, valid=whole(1), must="a whole number >= 1",
                       help="candidates kept per Medusa head (the largest rank a tree may use is topk - 1)")
    draft_stop: str | None = option(
        drafters=("draft_model",),
        help="draft models: when drafting stops each step: fixed | confidence:<t> | learned[:<t>] (default: the "
             "checkpoint's stopper if it has one, else fixed; inference.drafters.draft_stop)")
    head_vocab: int | None = option(
        drafters=("medusa",), type=int, metavar="S",
        help="Medusa heads: draft only from the S tokens most frequent in their training data (the checkpoint's "
             "token_counts.safetensors); cheaper heads, same lossless verification")
    lookup: int | None = option(
        drafters=TREE_DRAFTERS, type=int, metavar="N", valid=whole(1, MAX_LOOKUP),
        must=f"a whole number of tokens in [1, {MAX_LOOKUP}]",
        help="EAGLE-3 and Medusa: also verify a prompt-lookup chain of up to N tokens each step (what followed the "
             "latest earlier occurrence of the context's last tokens), grafted onto the tree "
             "(inference.drafters.with_lookup)")
    lookup_budget: int | None = option(
        drafters=TREE_DRAFTERS, type=int, metavar="M", valid=whole(1, MAX_BUDGET),
        must=f"a whole number of nodes in [1, {MAX_BUDGET}]",
        help="with --lookup and --datastore: verify the M likeliest nodes of the drafter's tree and the lookup's "
             "together, ranked by the drafter's path probabilities and the datastore's scores (instead of all of "
             "both)")
    # a spec (a source or several, joined by commas or listed: data.datastore) until `with_datastore` reads it, then
    # the Datastore
    datastore: str | Path | Sequence[str | Path] | Datastore | None = option(
        drafters=DATASTORE_DRAFTERS, metavar="SOURCE[,SOURCE...]",
        help="prompt_lookup, and EAGLE-3 and Medusa with --lookup: also draft a tree of the likeliest continuations "
             "from a corpus: a feature cache folder (its trained tokens), a ShareGPT file or folder of the target's "
             "answers, or a data recipe's name such as sharegpt_v3 (its train split's answers); several, joined by "
             "commas (or listed), are indexed together (data.datastore, inference.drafters.datastore)")
    datastore_grow: int | None = option(
        drafters=DATASTORE_DRAFTERS, type=int, metavar="N", valid=whole(1),
        must="a whole number of tokens >= 1 (the served answers' tokens kept)",
        help="where --datastore applies, with it or without: add every answer served to the datastore, keeping "
             "about the latest N tokens of them, so later requests draft from earlier answers (SuffixDecoding's "
             "global tree; each generation stays exact)")
    datastore_smoothing: str | None = option(
        drafters=DATASTORE_DRAFTERS, needs=STORE, metavar="|".join(SMOOTHINGS), valid=lambda v: v in SMOOTHINGS,
        must=f"one of {', '.join(SMOOTHINGS)}",
        help="with --datastore or --datastore-grow: the next token's distribution, interpolated over the matched "
             "suffixes' lengths (witten_bell, the default) or the longest match's counts alone (REST, "
             "SuffixDecoding)")
    datastore_request_weight: float | None = option(
        drafters=DATASTORE_DRAFTERS, needs=STORE, type=float, metavar="W", valid=number(0),
        must="a number >= 0 (how many times the request's own text counts)",
        help="with --datastore or --datastore-grow: how many times the request's own prompt and answer so far "
             f"count beside the datastore's corpus (default {REQUEST_WEIGHT:g}; 0: the corpus alone)")

    def with_datastore(self, tokenizer: Any, naming: Naming) -> "LoadOptions":
        """These options with `datastore` read and indexed (a path given; `tokenizer` encodes a text source), or an
        empty one made to grow (`datastore_grow` alone)."""
        if isinstance(self.datastore, Datastore) or (self.datastore is None and self.datastore_grow is None):
            return self
        store = load_datastore(self.datastore, tokenizer, label=naming.bare("datastore"),
                               max_served=self.datastore_grow or 0,
                               smoothing=self.datastore_smoothing or SMOOTHINGS[0],
                               request_weight=(REQUEST_WEIGHT if self.datastore_request_weight is None
                                               else self.datastore_request_weight))
        # the Datastore carries them (max_served, smoothing, request_weight)
        return replace(self, datastore=store, datastore_grow=None, datastore_smoothing=None,
                       datastore_request_weight=None)


OPTIONAL = tuple(f.name for f, opt in options_of(LoadOptions) if opt.drafters is not None)  # a type may not take
# the settings that shape a datastore `with_datastore` makes: they need one, and a Datastore object has its own
DATASTORE_SETTINGS = tuple(f.name for f, opt in options_of(LoadOptions) if opt.needs == STORE)


def takes(drafter_type: str) -> frozenset[str]:
    """The options of OPTIONAL that `drafter_type` takes."""
    return frozenset(f.name for f, opt in options_of(LoadOptions) if opt.drafters and drafter_type in opt.drafters)


def takers(name: str) -> list[str]:
    """The drafter types that take the option `name`, sorted."""
    return sorted(next(opt.drafters for f, opt in options_of(LoadOptions) if f.name == name) or ())


# the options that add the lookup's or the datastore's nodes to a drafter's tree (bench's build-tree fits the
# drafter's own tree, so it refuses them): `lookup`'s and every option prompt lookup's datastore takes
LOOKUP_OPTIONS = tuple(name for name in OPTIONAL if name.startswith("lookup") or name in takes("prompt_lookup"))


def check_options(options: LoadOptions, drafter_type: str, describe: str, naming: Naming = API) -> None:
    """Refuse, in one line, an option `drafter_type` (described as `describe`) does not take, a value that is not
    valid, and a combination that cannot work; reads no model (a datastore source's manifest at most)."""
    taken = takes(drafter_type)
    for name in OPTIONAL:
        if getattr(options, name) is not None and name not in taken:
            raise UsageError(f"{naming.arg(name)} does not apply to {describe}; it applies to "
                             f"{', '.join(takers(name))}")
    check(options, naming.arg)
    has_store = options.datastore is not None or options.datastore_grow is not None
    if options.lookup_budget is not None and (options.lookup is None or not has_store):
        raise UsageError(f"{naming.bare('lookup_budget')} needs {naming.bare('lookup')} and "
                         f"{naming.bare('datastore')}: it ranks the drafter's nodes and the lookup's by their "
                         f"scores, which the datastore gives")
    for name in DATASTORE_SETTINGS:
        if getattr(options, name) is None:
            continue
        if not has_store:
            raise UsageError(f"{naming.bare(name)} applies with {naming.bare('datastore')} or "
                             f"{naming.bare('datastore_grow')}: it sets how the datastore drafts")
        if isinstance(options.datastore, Datastore):
            raise UsageError(f"{naming.bare(name)} applies to a datastore source (a path) or none; a Datastore "
                             f"object is built with its settings (Datastore.configured)")
    if has_store:
        check_datastore(options, drafter_type, describe, naming)


def check_datastore(options: LoadOptions, drafter_type: str, describe: str, naming: Naming) -> None:
    """A tree drafter's datastore chain shares the nodes `lookup` adds, so it needs `lookup`; the source is checked
    here (a cache's manifest, a text source parsed whole), before any model or tokenizer loads."""
    if "lookup" in takes(drafter_type) and options.lookup is None:
        name = naming.bare("datastore" if options.datastore is not None else "datastore_grow")
        raise UsageError(f"{name} needs {naming.bare('lookup')} on {describe}: the datastore's tree shares the N "
                         f"nodes that {naming.bare('lookup')} N adds to its tree")
    if isinstance(options.datastore, Datastore) and options.datastore_grow is not None:
        raise UsageError(f"{naming.bare('datastore_grow')} applies to a datastore source (a path) or none; a "
                         f"Datastore object grows when built with max_served > 0")
    if options.datastore is not None and not isinstance(options.datastore, Datastore):
        check_spec(options.datastore, naming.bare("datastore"))
