"""LongBench-style metrics, written here: QA F1, ROUGE-L, classification accuracy, edit
similarity (code), counting / retrieval exact match. Every score is in [0, 1]; a sample's score
is the maximum over its reference answers.

Definitions:
  normalize(s): lowercase, punctuation removed, English articles (a / an / the) removed,
    whitespace collapsed.
  qa_f1: token-level F1 between normalize(prediction) and normalize(answer) word lists
    (bag-of-words overlap with multiplicity).
  rouge_l: ROUGE-L F-measure (beta = 1) from the longest common subsequence of the lowercased
    word lists (punctuation stripped).
  classification: the class names of `all_classes` that occur in the prediction, minus those
    that are a strict substring of the reference class; score = 1 / (number of matches) when
    the reference is among them, else 0.
  code_sim: 1 - Levenshtein(prediction line, answer) / max(len) on characters, where the
    prediction line is the first line that is neither blank nor a comment (`#`, `//`, `/*`).
  count: 1 when the first integer in the prediction equals the answer.
  retrieval: 1 when the first "Paragraph N" / integer in the prediction equals the answer's.
"""

from __future__ import annotations

import collections
import re
import string

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

METRICS = ("qa_f1", "rouge_l", "classification", "code_sim", "count", "retrieval")

# LongBench dataset name -> metric (the English datasets).
DATASET_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1",
    "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l", "samsum": "rouge_l",
    "trec": "classification", "lsht": "classification",
    "passage_count": "count", "passage_retrieval_en": "retrieval",
    "lcc": "code_sim", "repobench-p": "code_sim",
}


def normalize(s: str) -> str:
  s = s.lower()
  s = "".join(ch for ch in s if ch not in _PUNCT)
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def qa_f1(prediction: str, answer: str) -> float:
  p, a = normalize(prediction).split(), normalize(answer).split()
  if not p or not a:
    return float(p == a)
  common = collections.Counter(p) & collections.Counter(a)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(p), same / len(a)
  return 2 * precision * recall / (precision + recall)


def _words(s: str) -> list[str]:
  return "".join(ch if ch not in _PUNCT else " " for ch in s.lower()).split()


def lcs_length(a: list, b: list) -> int:
  if not a or not b:
    return 0
  prev = [0] * (len(b) + 1)
  for x in a:
    cur = [0]
    for j, y in enumerate(b):
      cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
    prev = cur
  return prev[-1]


def rouge_l(prediction: str, answer: str) -> float:
  p, a = _words(prediction), _words(answer)
  lcs = lcs_length(p, a)
  if lcs == 0:
    return 0.0
  precision, recall = lcs / len(p), lcs / len(a)
  return 2 * precision * recall / (precision + recall)


def classification(prediction: str, answer: str, all_classes=()) -> float:
  matches = [c for c in all_classes if c in prediction]
  matches = [c for c in matches if not (c in answer and c != answer)]
  if answer in matches:
    return 1.0 / len(matches)
  return 0.0


def levenshtein(a: str, b: str) -> int:
  if len(a) < len(b):
    a, b = b, a
  prev = list(range(len(b) + 1))
  for i, x in enumerate(a, 1):
    cur = [i]
    for j, y in enumerate(b, 1):
      cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
    prev = cur
  return prev[-1]


def edit_similarity(a: str, b: str) -> float:
  if not a and not b:
    return 1.0
  return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def first_code_line(prediction: str) -> str:
  for line in prediction.lstrip("\n").split("\n"):
    s = line.strip()
    if s and not s.startswith(("#", "//", "/*", "*", "`")):
      return line
  return ""


def code_sim(prediction: str, answer: str) -> float:
  return edit_similarity(first_code_line(prediction), answer)


def count(prediction: str, answer: str) -> float:
  m = re.search(r"\d+", prediction)
  return float(m is not None and m.group(0) == str(answer).strip())


def retrieval(prediction: str, answer: str) -> float:
  want = re.search(r"\d+", str(answer))
  m = re.search(r"[Pp]aragraph\s*(\d+)", prediction) or re.search(r"(\d+)", prediction)
  return float(m is not None and want is not None and m.group(1) == want.group(0))


_FN = {"qa_f1": qa_f1, "rouge_l": rouge_l, "code_sim": code_sim, "count": count,
       "retrieval": retrieval}


def score(metric: str, prediction: str, answers, all_classes=()) -> float:
  """max over `answers` of `metric`(prediction, answer)."""
  if metric not in METRICS:
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
  answers = [answers] if isinstance(answers, str) else list(answers)
  if not answers:
    raise ValueError("answers must be non-empty")
  if metric == "classification":
    return max(classification(prediction, a, all_classes) for a in answers)
  fn = _FN[metric]
  return max(fn(prediction, a) for a in answers)
