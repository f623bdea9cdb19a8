"""The OpenAI-compatible server (rocketkv_jax.serve): a real uvicorn server on localhost, driven
by the official `openai` client and raw HTTP. Greedy text must equal `rocketkv.generate`'s with
the engine's plan (pad_to = plan.prompt_len), alone or among concurrent requests; bad requests
are 4xx with OpenAI's error body; cancellation frees the slots; a full queue answers 503.

One server per module (a tiny random Llama with a character-level tokenizer written beside it),
its programs compiled once by `engine.warmup()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import tokenizers  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import rocketkv_jax as rocketkv  # noqa: E402
from rocketkv_jax.runtime.engine import Engine, EngineConfig  # noqa: E402
from rocketkv_jax.serve import build_app  # noqa: E402
from rocketkv_jax.serve import __main__ as cli  # noqa: E402
from model_fixtures import hf_checkpoint  # noqa: E402

KEY = "test-key"
NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROCKET = rocketkv.RocketConfig.recommended(64)
ENGINE = dict(max_model_len=256, max_new_tokens=64, max_num_seqs=4, max_waiting=16)


def tokenized_tiny(directory: str) -> str:
  """The tiny random Llama 3.1 checkpoint copied to `directory` with a character-level
  tokenizer over its 256 ids (1 = <s>, 2 = </s>; every other id one character) and a chat
  template, so that text goes in and out."""
  src, _ = hf_checkpoint("llama31")
  shutil.copytree(src, directory, dirs_exist_ok=True)
  chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
  c = 0xA1
  while len(chars) < 254:
    chars.append(chr(c))
    c += 1
  vocab = {t: i for i, t in enumerate([chars[0], "<s>", "</s>"] + chars[1:])}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  backend.decoder = tokenizers.decoders.Fuse()
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                              for t in ("<s>", "</s>")])
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
               "chat_template": CHAT_TEMPLATE}, f)
  return directory


@pytest.fixture(scope="module")
def tiny_dir():
  with tempfile.TemporaryDirectory(prefix="rocketkv_serve_") as d:
    yield tokenized_tiny(os.path.join(d, "tiny"))


class _Served:
  """The engine, its app under uvicorn on a free localhost port, and clients for it."""

  def __init__(self, model):
    self.model = model
    self.engine = Engine(model, EngineConfig(ROCKET, **ENGINE))
    self.engine.warmup()
    self.engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    self.port = sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.server = uvicorn.Server(uvicorn.Config(build_app(self.engine, NAME, KEY),
                                                log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]),
                                   daemon=True)
    self.thread.start()
    while not self.server.started:
      time.sleep(0.05)
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                                timeout=120)
    self.headers = {"Authorization": f"Bearer {KEY}"}

  def close(self):
    self.server.should_exit = True
    self.thread.join(30)
    self.engine.shutdown(5.0)

  def post(self, path, body, timeout=120.0):
    """A raw POST: `body` a dict (JSON) or bytes as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(self.url + path, content=data, timeout=timeout,
                      headers={**self.headers, "Content-Type": "application/json"})

  def metrics(self) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    text = httpx.get(self.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
      for s in fam.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
        le = s.labels.get("le")
        out[s.name + (f"{{{labels}}}" if labels else "") + (f"[{le}]" if le else "")] = s.value
    return out

  def idle(self, timeout=20.0) -> dict[str, float]:
    """Polls /metrics until no request runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
      m = self.metrics()
      if (m["rocketkv:num_requests_running"] == 0 and m["rocketkv:num_requests_waiting"] == 0
          and m["rocketkv:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
        return m
      time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tiny_dir):
  s = _Served(rocketkv.models.load(tiny_dir))
  yield s
  s.close()


def reference(served, prompt: str, n: int, chat: bool = False, eos: bool = False) -> str:
  """generate's greedy text with the engine's plan, cut to `n` tokens (independent of the
  server: its own programs, one request at a time). Without `eos` it never stops early."""
  plan = served.engine.plan
  res = rocketkv.generate(served.model, prompt, rocket_config=ROCKET, chat=chat,
                          max_new_tokens=plan.max_new_tokens, pad_to=plan.prompt_len,
                          temperature=0.0, eos_token_ids=None if eos else ())
  return served.model.tokenizer.decode(res.tokens[0][:n])


def prompt_of(i: int, length: int) -> str:
  """A deterministic ASCII prompt of `length` characters (length + 1 tokens with BOS)."""
  text = f"Request {i}: the quick brown fox jumps over the lazy dog {i * 7919}. "
  return (text * (length // len(text) + 1))[:length]


# ------------------------------------------------------------------ completions and chat
def test_models_health_and_greedy_completion_equal_generate(served):
  assert [m.id for m in served.client.models.list().data] == [NAME]
  assert httpx.get(served.url + "/health").status_code == 200
  prompt = prompt_of(0, 40)
  r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
  n = r.usage.completion_tokens
  assert r.usage.prompt_tokens == len(served.model.tokenizer.encode(prompt)) == 41
  assert r.usage.total_tokens == 41 + n
  # EOS honoured: 12 tokens ("length") unless generate's 12 tokens hold </s> (then "stop")
  ids = rocketkv.generate(served.model, prompt, rocket_config=ROCKET, temperature=0.0,
                          max_new_tokens=served.engine.plan.max_new_tokens,
                          pad_to=served.engine.plan.prompt_len, eos_token_ids=()).tokens[0]
  eos = [k for k, t in enumerate(ids[:12]) if t == 2]
  assert (n, r.choices[0].finish_reason) == ((eos[0], "stop") if eos else (12, "length"))
  assert r.choices[0].text == served.model.tokenizer.decode(ids[:n])
  assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")


def test_streamed_completion_with_usage(served):
  prompt = prompt_of(1, 70)
  stream = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
  chunks = list(stream)
  assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
  assert chunks[-1].usage.prompt_tokens == 71
  assert "".join(c.choices[0].text for c in chunks[:-1]) == reference(served, prompt, 20)
  assert len(chunks) > 3  # streamed, not one block


def test_raw_stream_is_sse_ending_with_done(served):
  r = served.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 5,
                                      "temperature": 0, "ignore_eos": True, "stream": True})
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
  events = [e for e in r.text.split("\n\n") if e]
  assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
  text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
  assert text == reference(served, "Hello", 5)


def test_guidellm_request_streams_with_continuous_usage(served):
  # the body guidellm 0.8 sends (captured): text parts, max_completion_tokens, ignore_eos and
  # vLLM's continuous_usage_stats, which puts the counts so far in every chunk
  body = {"model": NAME, "stream": True, "max_completion_tokens": 6, "ignore_eos": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True},
          "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]}
  r = served.post("/v1/chat/completions", body)
  assert r.status_code == 200, r.text
  chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
  counts = [c["usage"]["completion_tokens"] for c in chunks]
  assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["choices"] == []
  assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks[1:])


def test_chat_plain_and_streamed_equal_generate_with_the_template(served):
  question = "What is the capital of France?"
  want = reference(served, question, 16, chat=True)
  messages = [{"role": "user", "content": question}]
  r = served.client.chat.completions.create(model=NAME, messages=messages,
                                            max_completion_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
  assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
  assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
  prompt_len = len(served.model.tokenizer.encode(
      served.model.tokenizer.apply_chat_template(messages), add_special_tokens=False))
  assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 16
  chunks = list(served.client.chat.completions.create(
      model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True,
      extra_body={"ignore_eos": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
  assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(served):
  prompt = prompt_of(2, 30)
  full = reference(served, prompt, 24)
  stop = full[8:10]
  r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True})
  assert r.choices[0].text == full[:full.index(stop)]
  assert r.choices[0].finish_reason == "stop"


def test_concurrent_requests_equal_their_alone_result(served):
  """16 requests of different lengths at once (4 slots: most wait in the queue)."""
  jobs = [(prompt_of(i, 10 + 11 * i), 8 + 3 * i) for i in range(16)]
  want = [reference(served, p, n) for p, n in jobs]

  def one(job):
    p, n = job
    return served.client.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True})
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(one, jobs))
  assert [r.choices[0].text for r in got] == want
  assert [r.usage.completion_tokens for r in got] == [n for _, n in jobs]
  assert served.idle()["rocketkv:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------ metrics and cancellation
def test_metrics_count_one_request(served):
  before = served.idle()
  r = served.client.completions.create(model=NAME, prompt="Count me", max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
  usage = list(r)[-1].usage
  after = served.idle()

  def delta(name):
    return after.get(name, 0) - before.get(name, 0)
  assert delta("rocketkv:prompt_tokens_total") == usage.prompt_tokens == 9
  assert delta("rocketkv:generation_tokens_total") == usage.completion_tokens == 10
  assert delta("rocketkv:time_to_first_token_seconds_count") == 1
  assert delta("rocketkv:inter_token_latency_seconds_count") == 9
  assert delta("rocketkv:e2e_request_latency_seconds_count") == 1
  assert delta("rocketkv:request_success_total{finished_reason=length}") == 1
  # one prefill and 9 decode steps took some time; the split says where it went
  assert delta("rocketkv:prefill_seconds_total") > 0 and delta("rocketkv:decode_seconds_total") > 0
  assert after["rocketkv:num_slots"] == served.engine.num_slots == 4


def test_client_disconnect_aborts_and_frees_the_slot(served):
  aborted = "rocketkv:request_success_total{finished_reason=abort}"
  before = served.idle().get(aborted, 0)
  long = dict(model=NAME, prompt=prompt_of(3, 20), max_tokens=200, temperature=0,
              ignore_eos=True)
  stream = served.client.completions.create(
      stream=True, extra_body={"ignore_eos": True},
      **{k: v for k, v in long.items() if k != "ignore_eos"})
  for _, chunk in zip(range(3), stream):
    assert chunk.choices[0].finish_reason is None
  stream.close()  # the client goes away mid-stream
  m = served.idle()
  assert m[aborted] == before + 1
  assert m["rocketkv:kv_cache_usage_perc"] == 0 and m["rocketkv:num_requests_running"] == 0
  # a plain request whose client gives up (times out) is aborted too
  # (the most tokens its slot takes and a short timeout: a fast machine must not finish first)
  most = served.engine.max_tokens_for(len(served.model.tokenizer.encode(long["prompt"])))
  with pytest.raises(httpx.ReadTimeout):
    served.post("/v1/completions", dict(long, max_tokens=most), timeout=0.05)
  m = served.idle()
  assert m[aborted] == before + 2 and m["rocketkv:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------ bad requests
BAD = [
    # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'["a list"]', 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": ["one", "two"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_is_4xx_and_the_next_one_works(served, path, body, status, param):
  r = served.post(path, body)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"]
  assert err["param"] == param
  ok = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0,
                                       "ignore_eos": True})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_unknown_route_and_method_answer_openai_errors(served):
  r = httpx.get(served.url + "/v1/completions", headers=served.headers)
  assert r.status_code == 405 and r.json()["error"]["message"]
  r = httpx.get(served.url + "/v1/nothing", headers=served.headers)
  assert r.status_code == 404 and r.json()["error"]["message"]


def test_api_key_is_required_on_v1(served):
  body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
    r = httpx.post(served.url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
  assert httpx.get(served.url + "/v1/models").status_code == 401
  bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()
  assert httpx.get(served.url + "/health").status_code == 200


# ------------------------------------------------------------------ overload
def test_burst_past_max_waiting_gets_503_and_the_rest_complete(served):
  """40 long requests at once: the queue takes 16 (max_waiting), the slots 4 more once the
  engine admits them; the rest, arriving before any finishes, get 503."""
  body = {"model": NAME, "prompt": "burst", "max_tokens": 150, "temperature": 0,
          "ignore_eos": True}

  async def burst():
    async with httpx.AsyncClient(headers=served.headers, timeout=120) as c:
      return await asyncio.gather(*[c.post(served.url + "/v1/completions", json=body)
                                    for _ in range(40)])
  got = asyncio.run(burst())
  full = [r for r in got if r.status_code == 503]
  done = [r for r in got if r.status_code == 200]
  assert len(full) + len(done) == 40 and full and len(done) >= 16
  assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
             for r in full)
  texts = {r.json()["choices"][0]["text"] for r in done}
  assert len(texts) == 1 and texts.pop().startswith(reference(served, "burst", 64))
  assert all(r.json()["usage"]["completion_tokens"] == 150 for r in done)
  assert served.idle()["rocketkv:kv_cache_usage_perc"] == 0
  ok = served.client.completions.create(model=NAME, prompt="after", max_tokens=3)
  assert ok.usage.completion_tokens >= 1


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "64"], "needs more devices than the"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--block-size", "-1"], "--block-size must be >= 0 (0: no pages)"),
    (["--method", "magic"], "--method must be recommended or one of"),
    (["--budget", "0"], "--budget must be >= 1"),
    (["--prefill-tokens-per-step", "-1"], "--prefill-tokens-per-step must be >= 0"),
    (["--prefill-layer-groups", "0"], "--prefill-layer-groups must be >= 1 (1: one call)"),
    (["--port", "70000"], "--port must be in"),
    (["--model", "/no/such/model"], "model must be one of"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_cli_user_errors_exit_2(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith("error: ") and message in err
  assert err.count("\n") == 1


def test_cli_prefill_layer_groups_past_the_layers_exit_2(capsys, tiny_dir):
  """More layer groups than the model has layers (the tiny model's 2): one line, status 2."""
  with pytest.raises(SystemExit) as e:
    cli.main(["--model", tiny_dir, "--prefill-layer-groups", "3"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err == ("error: --prefill-layer-groups must be in [1, 2] (at "
                                       "most the model's 2 layers), got 3\n")


def test_missing_extra_names_it_in_one_line():
  code = ("import sys; sys.modules['fastapi'] = None\n"
          "try:\n  import rocketkv_jax.serve\nexcept ImportError as e:\n  print(e)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout == (
      "rocketkv_jax.serve needs the serve extra (missing fastapi): pip install "
      "'rocketkv-jax[serve]'\n"), out.stderr


def test_cli_serves_and_drains_on_sigterm(tiny_dir):
  """`python -m rocketkv_jax.serve` end to end: it serves, and on SIGTERM a running stream
  ends (finished or aborted: never cut off) and the process exits promptly with status 0."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  sock.close()
  proc = subprocess.Popen(
      [sys.executable, "-m", "rocketkv_jax.serve", "--model", tiny_dir, "--budget", "32",
       "--max-model-len", "128", "--max-new-tokens", "32", "--port", str(port),
       "--max-num-seqs", "2", "--shutdown-timeout", "1", "--uvicorn-log-level", "warning"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 240
    while True:
      assert proc.poll() is None, proc.stdout.read()
      try:
        if httpx.get(url + "/health").status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, "the server did not start"
      time.sleep(0.5)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert client.models.list().data[0].id == os.path.basename(tiny_dir)
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=90,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason in ("length", "abort")
    assert proc.wait(30) == 0 and time.monotonic() - t0 < 30
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
