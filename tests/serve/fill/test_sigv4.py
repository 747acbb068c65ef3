"""SigV4 against AWS's published S3 examples and against botocore's signer (moto's dependency) on awkward keys."""

from __future__ import annotations

import datetime

import pytest

from kev_backend.serve.fill import sigv4

# "Examples: Signature Calculations in AWS Signature Version 4" (Amazon S3 API reference): their keys, time, bucket.
EXAMPLE = sigv4.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC)
HOST = "examplebucket.s3.amazonaws.com"


@pytest.mark.parametrize(
    ("path", "query", "extra", "signed", "signature"),
    [
        (  # GET Object, with a Range header
            "/test.txt",
            {},
            {"Range": "bytes=0-9"},
            "host;range;x-amz-content-sha256;x-amz-date",
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
        ),
        (  # GET Bucket (List Objects)
            "/",
            {"max-keys": "2", "prefix": "J"},
            {},
            "host;x-amz-content-sha256;x-amz-date",
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
        ),
        (  # GET Bucket Lifecycle (a sub-resource without a value)
            "/",
            {"lifecycle": ""},
            {},
            "host;x-amz-content-sha256;x-amz-date",
            "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543",
        ),
    ],
)
def test_the_published_examples(path: str, query: dict, extra: dict, signed: str, signature: str) -> None:
    headers = sigv4.sign("GET", HOST, path, query, EXAMPLE, "us-east-1", WHEN, extra)
    assert headers["authorization"] == (
        f"AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    assert headers["x-amz-date"] == "20130524T000000Z" and headers["host"] == HOST


@pytest.mark.parametrize(
    ("key", "query"),
    [
        ("models/kev 4b/model-00001-of-00002.safetensors", {}),
        ("a+b/ü/~tilde/(x)!*'", {}),
        ("", {"list-type": "2", "prefix": "models/kev 4b/", "continuation-token": "1/+=AbC"}),
    ],
)
def test_agrees_with_botocore(key: str, query: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.auth
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path = f"/kev-models/{key}"
    url = f"http://127.0.0.1:9000{sigv4.canonical_path(path)}"
    url += f"?{sigv4.canonical_query(query)}" if query else ""
    credentials = sigv4.Credentials("AKIDEXAMPLE", "secret/with+chars", "session-token")
    ours = sigv4.sign("GET", "127.0.0.1:9000", path, query, credentials, "eu-west-3", WHEN)
    request = AWSRequest(method="GET", url=url, headers={"x-amz-content-sha256": sigv4.EMPTY_SHA256})
    signer = S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/with+chars", "session-token"), "s3", "eu-west-3")
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: WHEN.replace(tzinfo=None))
    signer.add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-security-token"] == "session-token"


def test_credentials_never_show_the_secret() -> None:
    assert "EXAMPLEKEY" not in repr(EXAMPLE) and "EXAMPLEKEY" not in str(EXAMPLE)
