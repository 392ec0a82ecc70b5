"""Image parts of chat requests in-process with a fake vLLM backend: count, size and source bounded before vLLM."""

import base64

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import error_of
from .test_generate import FakeVLLM

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3).decode()  # 776 bytes
DATA_URL = f"data:image/png;base64,{PNG}"


@pytest.fixture
def backend():
    return FakeVLLM()


@pytest.fixture
def client(backend):
    settings = GatewaySettings(max_chat_images=2, max_image_bytes=1000, max_prompt_chars=500,
                               chat_image_domains=["Images.Example.com"], health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c


def chat(*parts):
    content = [{"type": "text", "text": "what is it?"}, *parts]
    return {"model": "llm", "messages": [{"role": "user", "content": content}], "max_tokens": 8}  # relayed as sent


def image(url, **extra):
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_a_data_url_image_is_relayed_as_sent_and_not_counted_as_prompt_characters(client, backend):
    sent = chat(image(DATA_URL, detail="high"), {"image_url": DATA_URL})  # OpenAI's part, and the type-less form
    assert len(DATA_URL) > 500  # over max_prompt_chars: images are bounded apart from the text
    r = client.post("/v1/chat/completions", json=sent)
    assert r.status_code == 200, r.text
    assert backend.bodies == [sent] and backend.bodies[0]["messages"][0]["content"][1]["image_url"]["url"] == DATA_URL


def test_too_many_images_are_refused_naming_the_limit(client, backend):
    error = error_of(client.post("/v1/chat/completions", json=chat(*[image(DATA_URL)] * 3)), 400)
    assert error["param"] == "messages" and "3 images" in error["message"] and "at most 2" in error["message"]
    assert backend.bodies == []


def test_an_image_over_max_image_bytes_is_refused_naming_its_size_and_the_limit(client, backend):
    big = base64.b64encode(bytes(1001)).decode()
    error = error_of(client.post("/v1/chat/completions", json=chat(image(f"data:image/png;base64,{big}"))), 400)
    assert error["param"] == "messages"
    assert "1001 bytes" in error["message"] and "at most 1000" in error["message"]
    assert "messages[0].content[1]" in error["message"]
    assert backend.bodies == []


@pytest.mark.parametrize("url", [
    "data:image/png;base64,iVBO!w==",  # outside the alphabet
    "data:image/png;base64,iVBORw0",  # length not a multiple of 4
    "data:image/png;base64,iV=BOw==",  # padding inside
    "data:image/png;base64,iVBO Rw0K",  # whitespace
    "data:image/png,rawbytes",  # not base64
    "data:text/plain;base64,aGk=",  # not an image
    "data:image/png;base64",  # no comma
])
def test_a_data_url_that_is_not_base64_image_data_is_refused(client, backend, url):
    error = error_of(client.post("/v1/chat/completions", json=chat(image(url))), 400)
    assert error["param"] == "messages" and ("base64" in error["message"] or "data:image" in error["message"])
    assert backend.bodies == []


@pytest.mark.parametrize("url", ["https://evil.example.net/cat.png", "http://169.254.169.254/latest/meta-data",
                                 "https://images.example.com.evil.example.net/cat.png"])
def test_a_remote_image_url_is_refused_unless_its_host_is_allowed(client, backend, url):
    error = error_of(client.post("/v1/chat/completions", json=chat(image(url))), 400)
    assert "remote image URLs are not allowed" in error["message"] and "chat_image_domains" in error["message"]
    assert backend.bodies == []


def test_a_remote_image_url_of_an_allowed_host_is_relayed(client, backend):
    sent = chat(image("https://images.example.com/cats/1.png?size=2@x"),
                {"image_url": "http://IMAGES.example.com/2.jpg"})  # the type-less form, a plain string
    assert client.post("/v1/chat/completions", json=sent).status_code == 200
    assert backend.bodies == [sent]


@pytest.mark.parametrize("url", ["https://evil.example.net\\@images.example.com/cat.png",
                                 "https://images.example.com@evil.example.net/cat.png",
                                 "https://images.example.com /cat.png", "https://images.example.com/cat.png\n"])
def test_an_ambiguous_url_is_refused_whatever_its_host(client, backend, url):
    error = error_of(client.post("/v1/chat/completions", json=chat(image(url))), 400)
    assert "credentials, spaces or backslashes" in error["message"]
    assert backend.bodies == []


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://images.example.com/cat.png", "/etc/passwd", PNG,
                                 "gopher://images.example.com/", "http://[::1/cat.png"])
def test_file_and_other_schemes_are_always_refused(client, backend, url):
    error = error_of(client.post("/v1/chat/completions", json=chat(image(url))), 400)
    assert "file:" in error["message"] and error["param"] == "messages"
    assert backend.bodies == []


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": 42},
    {"type": "image_url", "image_url": ["data:image/png;base64,aGk="]},
    {"type": "image_url", "image_url": {}},
    {"type": "image_url", "image_url": {"url": None}},
    {"type": "image_url", "image_url": {"url": {"nested": "x"}}},
    {"type": "image_url"},
    {"image_url": None},
])
def test_a_malformed_image_part_is_a_400_not_a_500(client, backend, part):
    error = error_of(client.post("/v1/chat/completions", json=chat(part)), 400)
    assert "image_url must be" in error["message"] and error["param"] == "messages"
    assert backend.bodies == []


def test_other_parts_and_cached_image_references_pass_through(client, backend):
    sent = chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}},
                {"type": "image_url", "image_url": None, "uuid": "cat-1"}, "plain text part")
    assert client.post("/v1/chat/completions", json=sent).status_code == 200
    assert backend.bodies == [sent]


def test_chat_image_domains_is_read_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("RTXSERVE_CHAT_IMAGE_DOMAINS", '["images.example.com", "cdn.example.org"]')
    monkeypatch.setenv("RTXSERVE_MAX_CHAT_IMAGES", "0")
    settings = GatewaySettings()
    assert settings.chat_image_domains == ["images.example.com", "cdn.example.org"] and settings.max_chat_images == 0


def test_video_and_audio_urls_follow_the_image_url_rules():
    from serve.gateway.exceptions import InvalidRequest
    from serve.gateway.inputs.chat import check_chat_images
    from serve.gateway.settings import GatewaySettings

    limits = GatewaySettings(chat_image_domains=["media.example.com"])
    for kind in ("video_url", "audio_url"):
        for url in ("http://169.254.169.254/latest/meta-data/", "file:///etc/passwd"):
            with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[0\]"):
                check_chat_images(limits, [{"role": "user", "content": [{"type": kind, kind: {"url": url}}]}])
        check_chat_images(limits, [{"role": "user", "content": [{"type": kind, kind: {"url": "https://media.example.com/a"}}]}])
        check_chat_images(limits, [{"role": "user", "content": [{"type": kind, kind: {"url": "data:video/mp4;base64,AAAA"}}]}])
