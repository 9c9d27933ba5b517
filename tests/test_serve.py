"""The main job's command line and its refusal without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_elastic import serve


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "sglang_elastic.cli", *args], capture_output=True, text=True, **kw)


def test_dry_run_uses_the_embedded_llama_8b_shape_and_forwards_flags_last():
    r = cli("serve", "--dry-run", "--port", "31000", "--attention-backend", "triton")
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    model_dir = argv[argv.index("--model-path") + 1]
    cfg = json.loads(open(f"{model_dir}/config.json").read())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (32, 8, 4096)
    for flag in ("--skip-tokenizer-init", "--load-format"):
        assert flag in argv
    # The user's flags come as given, and a default the user overrode is gone.
    assert argv[-4:] == ["--port", "31000", "--attention-backend", "triton"]
    assert "flashinfer" not in argv and argv.count("--attention-backend") == 1
    assert argv[argv.index("--sampling-backend") + 1] == "pytorch"


def test_a_real_model_path_drops_the_dummy_weights_and_tokenizer_skip():
    argv = serve.build_command("llama-3.1-8b", ["--model-path", "/models/real", "--grammar-backend=xgrammar"], python="py")
    assert argv.count("--model-path") == 1 and "/models/real" in argv
    assert "--load-format" not in argv and "--skip-tokenizer-init" not in argv
    assert "--grammar-backend" not in argv[:-3] and argv[-1] == "--grammar-backend=xgrammar"


def test_unknown_embedded_model_is_a_clear_error():
    r = cli("serve", "--embedded-model", "gpt-7", "--dry-run")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("sglang-elastic serve: --embedded-model gpt-7: no such embedded model; use one of llama-3.1-70b, llama-3.1-8b, qwen2.5-32b, qwen2.5-7b, "
                        "or --model-path DIR for a real model\n")  # one line, no ValueError


@pytest.mark.skipif(serve.has_nvidia_gpu(), reason="this machine has a GPU: the no-GPU refusal cannot be observed")
def test_without_a_gpu_serve_exits_at_once_naming_the_test_command():
    r = cli("serve", timeout=120)
    assert r.returncode == 2
    assert "no NVIDIA GPU" in r.stderr and serve.TEST_COMMAND in r.stderr


def test_a_bad_flag_is_one_line_without_dry_run_too(monkeypatch, capsys):
    """Only ``--dry-run`` checked the flags (new-user finding): a start printed SGLang's usage text with the
    error at its end, and on a machine without a GPU said nothing of the flag. Every path checks them first."""
    execs = []
    monkeypatch.setattr(serve, "has_nvidia_gpu", lambda: True)  # a GPU host: the flags are what stops the start
    monkeypatch.setattr(serve.os, "execv", lambda *a: execs.append(a))
    rc = serve.serve("llama-3.1-8b", ["--enable-elastic-kv", "--elastic-kv-mode", "bogus"], require_patched=False)
    err = capsys.readouterr().err
    assert rc == 2 and execs == [] and len(err.splitlines()) == 1, err
    assert err.startswith("sglang-elastic serve: ") and "invalid choice: 'bogus'" in err
    assert serve.serve("llama-3.1-8b", ["--port", "31000"], require_patched=False) == 0 and len(execs) == 1  # good flags go on to the exec


def test_check_flags_merges_sglangs_config_file_as_the_server_does(tmp_path):
    """An enable switch given only in SGLang's ``--config`` YAML counts, as ``prepare_server_args`` merges the file
    (review finding: checking the flags on every path refused such a start); a missing file is one line."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable-elastic-kv: true\n")
    argv = serve.build_command("llama-3.1-8b", ["--config", str(cfg), "--elastic-kv-mode", "always-lent"])[3:]
    assert serve.check_flags(argv) is None
    cfg.write_text("elastic-kv-mode: always-lent\n")  # the mode without the switch, now from the file
    assert "needs --enable-elastic-kv" in serve.check_flags(serve.build_command("llama-3.1-8b", ["--config", str(cfg)])[3:])
    err = serve.check_flags(serve.build_command("llama-3.1-8b", ["--config", str(tmp_path / "none.yaml")])[3:])
    assert err.startswith("--config: Config file not found") and "\n" not in err


def test_launch_script_refuses_on_this_cpu_machine_before_installing_anything():
    if serve.has_nvidia_gpu():
        pytest.skip("GPU present")
    r = subprocess.run(["bash", "scripts/launch.sh"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and serve.TEST_COMMAND in r.stderr


def test_dry_run_refuses_what_the_server_start_would_refuse():
    """``serve --dry-run`` printed any command, however wrong (new-user finding):
    it now runs SGLang's parser with our flags and the plugin's checks."""
    r = cli("serve", "--dry-run", "--enable-kv-offload", "--page-size", "16", timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("sglang-elastic serve: --enable-kv-offload does not support --page-size 16") and len(r.stderr.splitlines()) == 1
    r = cli("serve", "--dry-run", "--enable-kv-offload", "--kv-offload-denominator", "estimate", timeout=300)  # with the radix cache
    assert r.returncode == 0, r.stderr
    assert "--enable-kv-offload" in r.stdout.split() and "--attention-backend" not in r.stdout.split()


@pytest.mark.parametrize("flags,message", [
    (["--kv-offload-topk", "2048"], "--kv-offload-topk (and every --kv-offload-* flag) needs --enable-kv-offload"),
    (["--enable-elastic-kv", "--speculative-algorithm", "NGRAM"], "--enable-elastic-kv does not support --speculative-algorithm 'NGRAM'"),
    (["--enable-kv-offload", "--disable-radix-cache", "--kv-offload-denominator", "exact"], "invalid choice: 'exact'"),
    (["--mem-fraction-static", "lots"], "invalid float value: 'lots'"),
    (["--attention-backend", "persistentkv"], "--attention-backend persistentkv: it is a decode-only backend"),
    (["--prefill-attention-backend", "persistentkv"], "--prefill-attention-backend persistentkv: it is a decode-only backend"),
    (["--attention-backend", "kvoffload"], "--attention-backend kvoffload runs over the offload pool: pass --enable-kv-offload"),
    # refused by the backend at its start, after the weights load; now by the flags (new-user finding: --dry-run passed them)
    (["--decode-attention-backend", "persistentkv", "--kv-cache-dtype", "fp8_e4m3"],
     "--decode-attention-backend persistentkv reads bf16/fp16 KV caches, not --kv-cache-dtype fp8_e4m3"),
    (["--decode-attention-backend", "persistentkv", "--kv-cache-dtype", "mxfp8"],
     "--decode-attention-backend persistentkv reads bf16/fp16 KV caches, not --kv-cache-dtype mxfp8"),
    (["--decode-attention-backend", "persistentkv", "--speculative-algorithm", "EAGLE"],
     "--decode-attention-backend persistentkv has no target-verify path for --speculative-algorithm EAGLE"),
    # review #32: refused only when the backend was built, after the weights (and the pinned host pool) loaded
    (["--decode-attention-backend", "persistentkv", "--dtype", "float32"],
     "--decode-attention-backend persistentkv reads bf16/fp16 KV caches, not the float32 one --dtype float32 gives"),
    (["--decode-attention-backend", "persistentkv", "--dcp-size", "2"], "--decode-attention-backend persistentkv does not support --dcp-size 2"),
    (["--enable-kv-offload", "--dtype", "float"], "--enable-kv-offload does not support --dtype float: the kernels read bf16/fp16 KV"),
    (["--enable-kv-offload", "--kv-offload-eviction", "lfu", "--context-length", "4194304"],
     "--kv-offload-eviction lfu packs a slot's last use in 21 bits: contexts below 2,097,152 positions, not 4,194,304"),
    (["--enable-kv-offload", "--kv-offload-eviction", "lfu", "--json-model-override-args", '{"max_position_embeddings": 2097152}'],
     "not 2,097,152 (use lru, or a shorter --context-length)"),
    (["--decode-attention-backend", "persistentkv", "--decode-calibration", ""],
     "--decode-calibration needs the path of a calibration JSON, not an empty value"),
])
def test_check_flags_names_the_first_refusal(flags, message):
    argv = serve.build_command("llama-3.1-8b", flags)[3:]
    err = serve.check_flags(argv)
    assert err is not None and message in err and "\n" not in err
    assert serve.check_flags(serve.build_command("llama-3.1-8b", ["--port", "31000"])[3:]) is None
    # the project's own backends are choices there, as at a server start (the first version refused them)
    assert serve.check_flags(serve.build_command("llama-3.1-8b", ["--decode-attention-backend", "persistentkv"])[3:]) is None
    assert serve.check_flags(serve.build_command("llama-3.1-8b", ["--decode-attention-backend", "persistentkv", "--kv-cache-dtype", "bf16"])[3:]) is None
    for ok in (["--decode-attention-backend", "persistentkv", "--dtype", "float16"], ["--enable-kv-offload", "--dtype", "auto"],
               ["--enable-kv-offload", "--kv-offload-eviction", "lfu", "--context-length", "131072"],
               ["--enable-kv-offload", "--dtype", "float32", "--kv-cache-dtype", "bf16"]):  # the KV cache's own dtype given
        assert serve.check_flags(serve.build_command("llama-3.1-8b", ok)[3:]) is None, ok
    assert serve.check_flags(serve.build_command("llama-3.1-8b", ["--enable-kv-offload", "--disable-radix-cache", "--attention-backend",
                                                                  "kvoffload"])[3:]) is None


def test_a_flag_set_in_the_config_file_gets_no_default_beside_it(tmp_path):
    """Review finding (#32): ``serve`` added its defaults for flags the user had set in ``--config``'s YAML, and the
    command line beats the file: the file's model became the embedded dummy shape, its backend FlashInfer, and its
    ``enable-kv-offload: true`` was refused for a ``--attention-backend`` the user never gave."""
    model = tmp_path / "mymodel"
    model.mkdir()
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"model-path: {model}\nattention-backend: triton\ngrammar-backend: xgrammar\n")
    cmd = serve.build_command("llama-3.1-8b", ["--config", str(cfg)])
    assert not any(f in cmd for f in ("--model-path", "--load-format", "--skip-tokenizer-init", "--attention-backend", "--grammar-backend"))
    assert cmd[3:] == ["--sampling-backend", "pytorch", "--config", str(cfg)]  # the one default the file left unset
    cfg.write_text("enable-kv-offload: true\n")
    cmd = serve.build_command("llama-3.1-8b", ["--config", str(cfg)])
    assert "--attention-backend" not in cmd and "--model-path" in cmd  # the embedded shape: the file names no model
    assert serve.check_flags(cmd[3:]) is None
    cfg.write_text("enable-kv-offload: false\n")  # off in the file: the backend default comes back
    assert "--attention-backend" in serve.build_command("llama-3.1-8b", ["--config", str(cfg)])


def test_the_offload_flags_that_are_not_plain_values_can_be_set_in_the_config_file(tmp_path):
    """Review finding (#32): SGLang's ``--config`` merger takes only store and store_true options, so
    ``kv-offload-keep-v: false`` and ``kv-offload-dense-launch`` in the YAML stopped the launch with a traceback.
    Now ``--kv-offload-keep-v [BOOL]`` / ``--no-kv-offload-keep-v`` and the once-only dense launch are store
    options: the file sets them as the command line does, and a bad value is one line."""
    import argparse

    from sglang_elastic import config

    cfg = tmp_path / "o.yaml"
    parser = serve._parser()
    for text, keep_v, launch in (("kv-offload-keep-v: false\n", False, ""), ("kv-offload-keep-v: true\n", True, ""),
                                 ("no-kv-offload-keep-v: true\n", False, ""), ("kv-offload-dense-launch: fused=0,pdl=0\n", None, "fused=0,pdl=0")):
        cfg.write_text("enable-kv-offload: true\n" + text)
        argv = serve.build_command("llama-3.1-8b", ["--config", str(cfg)])[3:]
        assert serve.check_flags(argv) is None, text
        c = config.from_namespace(parser.parse_args(serve._merge_config(argv, parser))).offload
        assert (c.keep_v, c.dense_launch) == (keep_v, launch), text
    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    for argv, want in ((["--kv-offload-keep-v"], True), (["--kv-offload-keep-v=off"], False), (["--no-kv-offload-keep-v"], False),
                       (["--no-kv-offload-keep-v", "false"], True), ([], None)):
        assert p.parse_args(argv).kv_offload_keep_v is want, argv
    err = serve.check_flags(serve.build_command("llama-3.1-8b", ["--enable-kv-offload", "--kv-offload-keep-v", "maybe"])[3:])
    assert err == "launch_server: error: argument --kv-offload-keep-v: expected true or false, not 'maybe'"


def test_an_events_file_that_cannot_be_written_is_refused_before_the_start(tmp_path, monkeypatch):
    """Review #32: ``SGLANG_ELASTIC_EVENTS`` under a missing directory passed ``serve --dry-run``; the scheduler opened it
    after the weights loaded and the graphs captured, without a handler. A writable path passes."""
    argv = serve.build_command("llama-3.1-8b", ["--enable-elastic-kv"])[3:]
    for bad in (tmp_path / "none" / "ev.jsonl", tmp_path):
        monkeypatch.setenv("SGLANG_ELASTIC_EVENTS", str(bad))
        assert serve.check_flags(argv) == f"SGLANG_ELASTIC_EVENTS={bad}: not a file that can be written (the lend/reclaim records are appended there)"
    monkeypatch.setenv("SGLANG_ELASTIC_EVENTS", str(tmp_path / "ev.jsonl"))
    assert serve.check_flags(argv) is None and not (tmp_path / "ev.jsonl").exists()  # checked, not created


def test_dense_launch_keys_join_over_the_config_file_and_the_command_line(tmp_path):
    """Review #32: a ``kv-offload-dense-launch`` in the YAML and one on the command line were refused as given twice;
    now their keys join, the command line's value of a key winning (CLI > file, as for every option), and a key twice in
    one value is still refused."""
    from sglang_elastic import config

    cfg = tmp_path / "dl.yaml"
    cfg.write_text("enable-kv-offload: true\nkv-offload-dense-launch: min_chunk=1024,pdl=0\n")
    parser = serve._parser()
    argv = serve.build_command("llama-3.1-8b", ["--config", str(cfg), "--kv-offload-dense-launch", "min_chunk=2048,fused=0"])[3:]
    assert serve.check_flags(argv) is None
    c = config.from_namespace(parser.parse_args(serve._merge_config(argv, parser))).offload
    assert c.dense_launch == "pdl=0,min_chunk=2048,fused=0"
    sp = c.split_config()
    assert (sp.dense_min_chunk, sp.dense_pdl, sp.dense_fused) == (2048, False, False)
    assert config._merged_launch(["a=1,b=2", "b=3", "a=4,c=5"]) == "b=3,a=4,c=5"


def test_the_start_up_checks_read_the_model_as_sglang_does(tmp_path, monkeypatch):
    """Review #32 follow-ups: the lfu bound takes SGLang's own context length (its first context key, times the RoPE
    factor), a ``~`` model path is expanded, an events file that exists needs only to be writable (``/dev/null``),
    and ``--embedded-model`` is not checked when the YAML names a model."""
    import json

    base = ["--enable-kv-offload", "--kv-offload-eviction", "lfu"]
    for over, refused in (({"rope_scaling": {"rope_type": "linear", "factor": 32.0}}, True), ({"seq_length": 4194304}, True),
                          ({"max_position_embeddings": 4194304, "max_sequence_length": 8192}, False)):
        err = serve.check_flags(serve.build_command("llama-3.1-8b", base + ["--json-model-override-args", json.dumps(over)])[3:])
        assert (err is not None and "lfu packs a slot's last use in 21 bits" in err) == refused, (over, err)
    home = tmp_path / "home"
    (home / "m").mkdir(parents=True)
    (home / "m" / "config.json").write_text((serve.model_path("llama-3.1-8b") / "config.json").read_text())
    monkeypatch.setenv("HOME", str(home))
    assert serve.check_flags(serve.build_command("x", ["--model-path", "~/m", "--tp", "3"])[3:]).startswith("--tp 3: the model's 32")
    monkeypatch.setenv("SGLANG_ELASTIC_EVENTS", os.devnull)
    assert serve.check_flags(serve.build_command("llama-3.1-8b", ["--enable-elastic-kv"])[3:]) is None
    monkeypatch.delenv("SGLANG_ELASTIC_EVENTS")
    cfg = tmp_path / "mp.yaml"
    cfg.write_text(f"model-path: {home / 'm'}\n")
    assert serve.serve("nope", ["--config", str(cfg)], dry_run=True) == 0
    assert serve.serve("nope", []) == 2
