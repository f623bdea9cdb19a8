"""`rocketkv.Conversation` on a ("dp", "tp") = (2, 2) mesh of 4 host devices gives every turn
the tokens of one device: 3 ragged conversations (one "dp" padding row), a row that stops at
an EOS, RocketKV-MT evicting below the conversation, streaming, and Gemma 3's sliding layers
beside the recommended RocketKV.
Runs in a subprocess because the device count is fixed at JAX start-up."""

from model_fixtures import gemma3_checkpoint, hf_checkpoint, run_on_host_devices

_SCRIPT = """
    toks = random_tokens(9, 40, seed=5)
    turns = [[toks[0].tolist(), toks[1, :27].tolist(), toks[2, :33].tolist()],
             [toks[3, :9].tolist(), toks[4, :14].tolist(), toks[5, :3].tolist()],
             [toks[6, :5].tolist(), toks[7, :11].tolist(), toks[8, :7].tolist()]]

    def talk(model, cfg, eos, n_turns, stream=False):
      conv = rocketkv.Conversation(model, rocket_config=cfg, max_new_tokens=6,
                                   eos_token_ids=eos, turn_pad=8)
      out = []
      for messages in turns[:n_turns]:
        seen = []
        res = conv.send(messages, stream=(lambda s, t, d: seen.append(t.tolist()))
                        if stream else None)
        if stream:  # the stream's rows are the caller's, up to each row's EOS
          assert [list(r)[:len(a)] for r, a in zip(zip(*seen), res.tokens)] == res.tokens
        out.append((res.tokens, res.stats["context_lengths"], res.stats["kv_tokens_kept"]))
      return out

    def stopping_eos(model, cfg):
      # an EOS that stops some row early on the first turn (a token of its answer that did not
      # come earlier in it), so that row's cache is trimmed at turn 2
      for row in rocketkv.generate(model, turns[0], rocket_config=cfg, max_new_tokens=6,
                                   eos_token_ids=()).tokens:
        for i in range(1, 5):
          if row[i] not in row[:i]:
            return (row[i],)
      return ()  # (the tiny Gemma 3 at this budget repeats one token: no EOS to trim there)

    # RocketKV-MT's turn (stage 1 re-run on the full cache) on Llama; on Gemma 3 the appending
    # turn (grown cache, stage-2 state rebuilt: the recommended Quant codes) beside its sliding
    # layers' window
    cases = (
        ("llama_tp", {llama!r}, 3,
         [rocketkv.RocketConfig(token_budget=24, method="rocketkv_mt", window_size=8,
                                kernel_size=3)]),
        ("gemma3", {gemma!r}, 2,
         [rocketkv.RocketConfig.recommended(24, window_size=8, kernel_size=3)]))
    for name, path, n_turns, cfgs in cases:
      single = M.load(path)
      mesh = M.load(path, mesh=sharding.make_mesh(tp=2, dp=2))
      for cfg in cfgs:
        eos = stopping_eos(single, cfg)
        a = talk(single, cfg, eos, n_turns)
        b = talk(mesh, cfg, eos, n_turns, stream=name == "llama_tp")
        assert a == b, (name, cfg.method, a, b)
        if name == "llama_tp":  # a row stopped at the EOS on turn 1
          assert eos and min(len(t) for t in a[0][0]) < 6, a
    print("MESH-OK")
"""


def test_conversation_on_a_dp_tp_mesh_matches_one_device():
  llama, _ = hf_checkpoint("llama_tp")  # written here: the child never imports torch
  gemma, _ = gemma3_checkpoint()
  out = run_on_host_devices(_SCRIPT.format(llama=llama, gemma=gemma), devices=4, timeout=900)
  assert out.returncode == 0 and "MESH-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-6000:]
