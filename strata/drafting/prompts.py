"""Prompts a drafter is trained on: made here, nothing downloaded, and none of them is a prompt
`strata bench spec` measures with (its templates, topics and documentation modules are kept out,
so the bench's prompts are held out).

  chat      open questions: templates x topics
  grounded  an instruction over a passage of the standard library's documentation (modules other
            than the bench's), so the answer re-uses the input
"""

from __future__ import annotations

import itertools
import random

from strata.bench.spec import (
    CHAT_TEMPLATES,
    CHAT_TOPICS,
    DOC_MODULES,
    doc_paragraphs,
    doc_passages,
)

TRAIN_TEMPLATES = (
    "Tell me about {}.",
    "Write a short essay on {}.",
    "What should a beginner know about {}?",
    "Summarize the history of {} in a few sentences.",
    "Write a letter to a friend about {}.",
    "List three surprising facts about {}.",
    "How would you explain {} to a grandparent?",
    "Write a dialogue between two people discussing {}.",
    "What are common mistakes people make with {}?",
    "Write a haiku and then a limerick about {}.",
    "Describe {} using only simple words.",
    "Give a step-by-step guide related to {}.",
    "Why do people care about {}?",
    "Write a news headline and a short article about {}.",
    "Compare {} with something from everyday life.",
    "Answer briefly: what is the most important thing about {}?",
)
TRAIN_TOPICS = (
    "gardening",
    "the solar system",
    "a train journey",
    "friendship",
    "learning a language",
    "recycling",
    "a busy kitchen",
    "birds in winter",
    "a football match",
    "the internet",
    "a rainy afternoon",
    "painting",
    "a village market",
    "sleep",
    "a desert",
    "computers",
    "a museum",
    "music lessons",
    "the weather",
    "a birthday party",
    "forests",
    "a camping trip",
    "healthy breakfasts",
    "a dog and a cat",
    "city parks",
    "a sailing boat",
    "mathematics",
    "an old clock",
    "coffee",
    "a snowstorm",
    "public libraries",
    "honey",
    "a space station",
    "rivers",
    "handwriting",
    "a science fair",
    "bicycles",
    "a theater play",
    "the human heart",
    "a quiet morning",
    "an apple orchard",
    "a fishing village",
    "the printing press",
    "a thunderstorm",
    "origami",
    "a night train",
    "volunteering",
    "a marathon",
    "glaciers",
    "a school garden",
    "a street musician",
    "board games",
    "a windmill",
    "photography",
    "a bus driver",
    "tea ceremonies",
    "the periodic table",
    "a treehouse",
    "knitting",
    "a mountain lake",
    "a farmers' cooperative",
    "a spelling bee",
    "recycling old phones",
    "a power outage",
    "an ant colony",
    "the first airplane",
    "a post office",
    "a night sky without the moon",
    "kites",
    "a quiet neighbour",
    "pottery",
    "a hospital night shift",
    "sunflowers",
    "a pen pal",
    "public transport",
    "a fire station",
    "the Roman roads",
    "dolphins",
    "an online course",
    "a lemonade stand",
    "a broken bicycle chain",
    "a school choir",
    "a rainforest",
    "chess openings",
    "a family recipe",
    "a flea market",
    "a wind farm",
    "the alphabet",
    "a rowing team",
    "a snowman",
    "a carpenter's workshop",
    "the Silk Road",
    "a weather balloon",
    "a quiet cafe",
    "an aquarium",
    "a first job",
    "the tides",
    "a garden pond",
    "a lost key",
    "a hot air balloon",
    "a science teacher",
    "coral reefs",
    "a city at midnight",
    "paper money",
    "a wildlife photographer",
    "a tennis racket",
    "a summer festival",
    "a long queue",
    "a vegetable soup",
    "the postal service",
    "a sand castle",
    "a harvest moon",
    "a piano tuner",
    "shoes",
    "a mapmaker",
    "a night at the observatory",
    "a folk song",
    "a spring cleaning",
)
# the standard library's modules whose documentation the grounded prompts quote (none of the bench's)
TRAIN_DOC_MODULES = (
    "abc",
    "array",
    "base64",
    "bz2",
    "cmd",
    "code",
    "codecs",
    "colorsys",
    "copy",
    "dis",
    "filecmp",
    "fnmatch",
    "ftplib",
    "getopt",
    "gettext",
    "graphlib",
    "hashlib",
    "hmac",
    "html.parser",
    "locale",
    "lzma",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pdb",
    "platform",
    "plistlib",
    "poplib",
    "pstats",
    "quopri",
    "reprlib",
    "selectors",
    "shelve",
    "shlex",
    "site",
    "stat",
    "struct",
    "sys",
    "sysconfig",
    "trace",
    "tracemalloc",
    "types",
    "wave",
    "xml.dom.minidom",
    "zipimport",
    "zlib",
)
GROUNDED_TASKS = (
    "Rewrite the passage above with any spelling mistakes corrected. Keep everything else exactly as it is.",
    "Repeat the passage above word for word.",
    "Copy the first paragraph of the passage above, then explain it in one sentence.",
    "Rewrite the passage above as a bulleted list, keeping its wording.",
    "Quote the sentence of the passage above that matters most, then explain why.",
    "Summarize the passage above in three sentences.",
)
GROUNDED_FRAME = (
    "Here is a passage from a program's documentation:\n\n{passage}\n\n{task}"
)

assert not set(TRAIN_TEMPLATES) & set(CHAT_TEMPLATES)
assert not set(TRAIN_TOPICS) & set(CHAT_TOPICS)
assert not set(TRAIN_DOC_MODULES) & set(DOC_MODULES)


def chat_prompts() -> list[str]:
    return [
        t.format(topic) for topic, t in itertools.product(TRAIN_TOPICS, TRAIN_TEMPLATES)
    ]


def grounded_prompts(tokenizer, passage_tokens: int) -> list[str]:
    # a docstring inherited by a bench module's class and one of ours is the bench's alone
    held_out = frozenset(doc_paragraphs(DOC_MODULES))
    passages = doc_passages(tokenizer, passage_tokens, TRAIN_DOC_MODULES, held_out)
    # two tasks per passage, three apart: one that copies it and one that does not
    n = len(GROUNDED_TASKS)
    return [
        GROUNDED_FRAME.format(passage=p, task=GROUNDED_TASKS[(i + k * n // 2) % n])
        for i, p in enumerate(passages)
        for k in range(2)
    ]


def training_prompts(
    tokenizer, chat: int, grounded: int, passage_tokens: int, seed: int
) -> list[str]:
    """`chat` open questions and `grounded` documentation tasks (fewer where there are not as
    many), shuffled by `seed`."""
    rng = random.Random(seed)
    pools = (chat_prompts(), grounded_prompts(tokenizer, passage_tokens))
    picked = []
    for pool, n in zip(pools, (chat, grounded)):
        picked += rng.sample(pool, min(n, len(pool)))
    rng.shuffle(picked)
    return picked
