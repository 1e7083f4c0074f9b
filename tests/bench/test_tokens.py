from pathlib import Path

from pdserve.bench.tokens import TokenSource
from tests.model.test_gguf_convert import write_tiny_gguf


def test_a_gguf_file_lends_its_own_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """`--tokenizer x.gguf` (what `--model x.gguf` passes down) reads the file's tokenizer,
    rather than parsing the GGUF as a tokenizer.json."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")[0]
    source = TokenSource.load(str(gguf_path))
    assert source.decode(source.encode("hello world")) == "hello world"
