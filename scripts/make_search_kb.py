#!/usr/bin/env python
"""Generate the synthetic knowledge base of the search-agent demo (deterministic, seeded; no download).

Writes two committed files under ``producers/data``:

- ``search_kb.jsonl``: one document per line, ``{"doc_id": "<name>", "text": "the code of <name> is <code>"}``;
- ``search_qa.jsonl``: one question per document, in the same order,
  ``{"question": "code of <name>?\\n", "answer": "<code>", "entity": "<name>"}``.

There are :data:`N_ENTITIES` entities. A name is a made-up, pronounceable
lowercase 5-letter word, consonant-vowel-consonant-vowel-consonant (consonants
:data:`CONSONANTS`, vowels :data:`VOWELS`); names are unique and none is in
:data:`ENGLISH_WORDS`, a list of common English words of that shape. A code is
a random integer in 100..999, as a string, distinct across entities (so an answer is in exactly one
document).
The answers are only in the corpus: a model cannot know an entity's code
without looking it up.

Usage: ``scripts/make_search_kb.py [--out DIR] [--seed S] [--n N]``. Re-running
with the defaults rewrites the committed files byte for byte.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

N_ENTITIES = 512
SEED = 0
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
KB_FILE = "search_kb.jsonl"
QA_FILE = "search_qa.jsonl"
DATA_DIR = Path(__file__).resolve().parents[1] / "producers" / "data"

#: Common English words (and a few names) of the consonant-vowel-consonant-vowel-consonant shape over
#: :data:`CONSONANTS` and :data:`VOWELS`; no generated name is one of them.
ENGLISH_WORDS = frozenset("""
babes bagel baked baker bakes bales banal baron basal based bases basil basin baton befit begin begun besom
bevel bides bigot biker bikes biped bipod bison biter boded bodes bogus boles boned bones bonus bored bores
boron bosun dales dames damit dated dates debit debut demon demur denim devil digit dimes dinar dined diner
dines divan dived diver dives doled domed domes donor doped dopes dosed dotal doted dotes dozed dozen dozer
dukes dunes duped dupes dural faded fader fades fakes fakir famed fames fatal fated felon femur fetal fetes
fetid fetus filed filer final fined finer fines fired fires fives forum fumed fumes fused fuses gales gamed
gamer games gamut gapes gated gates gavel gazed gelid gemot genes genet genus gibes given gives godot gonad
goner gored gules kabob kafir kales kapok karat kazan kebab kevin kilos kines kites kudos kulak kumis label
laden lades lager lakes lamed lamer lanes lapel lapis lased laser legal lemon lemur lepus level libel lifes
limen limes limit lined linen liner lipid liter liver lives livid lobar lobed lobes logos loner loses lotus
lover loves lumen lunar lupin lupus lured lures lurid lutes madam maker malar males mamas manes manor mares
maser mason mated mater mates mazes medal melon menus merit metal meter metes mikes milan miles mimed mined
miner mines minor minus mites modal model modem modes modus mogul molar moles moped mopes moral morel motel
motif motor mover moves mules mumus mural mused mutes nadir named namer names napes nares nasal natal naval
navel nevus nines nobel nodal nodes nomad noted notes nuder pagan pages pales panel panes papal paper pares
pater pedal penal peril petal pikes piled pilot pined pines piped pipes pivot polar poled poles pored pores
posed poser poses posit pukes pupil rabid radar rages rakes ramen rapid rated rater rates raven razed razor
rebel rebus refer refit regal remit remus renal repel reset resin rider rides rigid riled rimes riper ripes
risen riser rises rites riven river rivet robed robes robin robot roles roman roped roses rotas rotor rover
roves ruled ruler rules rumen rumor rupes rural sabot sages salad sales salon salut sapid sated satin saver
sedan semen sepal serif seven sided sides sines sinus siren sires sitar sites sizes sober solan solar soled
solid solus sonar sores sumos super tabes tabor taker tales tamal tamed tamer tames tapas taped taper tapes
tapir tenet tenor tepid tidal tided tides tikes tiled tiles timed timer times timid tired tires titan tofus
token tomes tonal toned toner tones topaz toper torus total toted tubas tuber tubes tumid tumor tunas tuned
tunes tutor vagus vales valid valor vanes vapid vapor vases venom venus vigil vigor vines visit visor vital
vivid vizor vomit voted voter votes zakat zebus zonal zoned zones
babel burin doser latus nitid ropes ruder
""".split())


def make_names(rng: random.Random, n: int) -> list[str]:
    """``n`` unique CVCVC names in the order drawn, skipping :data:`ENGLISH_WORDS` and repeats.

    Raises:
        ValueError: ``n`` exceeds the number of possible names.
    """
    space = len(CONSONANTS) ** 3 * len(VOWELS) ** 2
    if n > space - len(ENGLISH_WORDS):
        raise ValueError(f"cannot draw {n} unique names from about {space} CVCVC words")
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        name = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(5))
        if name not in seen and name not in ENGLISH_WORDS:
            seen.add(name)
            names.append(name)
    return names


def make_kb(seed: int = SEED, n: int = N_ENTITIES) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The knowledge base and its questions: ``(docs, qa)``, two lists of ``n`` dicts in entity order.

    ``docs[i]`` is ``{"doc_id": name, "text": "the code of <name> is <code>"}`` and
    ``qa[i]`` is ``{"question": "code of <name>?\\n", "answer": code, "entity": name}``;
    codes are distinct 3-digit strings ("100".."999"). Deterministic in ``seed``.

    Raises:
        ValueError: ``n`` exceeds the number of possible names or of distinct codes (900).
    """
    rng = random.Random(seed)
    names = make_names(rng, n)
    codes = [str(c) for c in rng.sample(range(100, 1000), n)]
    docs = [{"doc_id": name, "text": f"the code of {name} is {code}"} for name, code in zip(names, codes)]
    qa = [{"question": f"code of {name}?\n", "answer": code, "entity": name} for name, code in zip(names, codes)]
    return docs, qa


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Write ``rows`` to ``path`` as JSONL (one compact JSON object a line, ``\\n`` line ends, UTF-8)."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    """Command-line entry point: write ``search_kb.jsonl`` and ``search_qa.jsonl`` to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output directory (default: producers/data)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--n", type=int, default=N_ENTITIES, help="number of entities")
    args = parser.parse_args()
    docs, qa = make_kb(args.seed, args.n)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / KB_FILE, docs)
    write_jsonl(args.out / QA_FILE, qa)
    print(f"wrote {len(docs)} documents to {args.out / KB_FILE} and {len(qa)} questions to {args.out / QA_FILE}")


if __name__ == "__main__":
    main()
