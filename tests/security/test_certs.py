"""The local CA and service certificates: names, usages, file modes, reuse of an existing CA."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from aiworks.core.errors import InvalidArgument
from aiworks.security.certs import CertificateError, write_certificates


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_ca_server_and_service_certificates(tmp_path):
    result = write_certificates(tmp_path, ["localhost", "127.0.0.1"], ["gateway", "scheduler"])
    assert result.ca_created
    for name in ("ca.crt", "ca.key", "tls.crt", "tls.key"):
        assert (tmp_path / name).is_file()
    for svc in ("gateway", "scheduler"):
        for name in ("tls.crt", "tls.key", "ca.crt"):
            assert (tmp_path / svc / name).is_file()
    for key in [tmp_path / "ca.key", tmp_path / "tls.key", tmp_path / "gateway" / "tls.key"]:
        assert _mode(key) == 0o600, key
    assert _mode(tmp_path / "tls.crt") == 0o644


def test_certificates_chain_to_the_ca_with_the_right_names_and_usages(tmp_path):
    write_certificates(tmp_path, ["localhost", "127.0.0.1", "aiworks.example"], ["scheduler"])
    ca = _cert(tmp_path / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = _cert(tmp_path / "scheduler" / "tls.crt")
    leaf.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    assert leaf.public_key().curve.name == "secp256r1"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "aiworks.example", "scheduler"}
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (tmp_path / "scheduler" / "ca.crt").read_bytes() == (tmp_path / "ca.crt").read_bytes()


def test_existing_ca_is_reused_and_replaced_only_with_force(tmp_path):
    write_certificates(tmp_path, ["localhost"])
    ca_before = (tmp_path / "ca.crt").read_bytes()
    again = write_certificates(tmp_path, ["localhost"], ["cache"])
    assert not again.ca_created
    assert (tmp_path / "ca.crt").read_bytes() == ca_before
    _cert(tmp_path / "cache" / "tls.crt").verify_directly_issued_by(_cert(tmp_path / "ca.crt"))
    forced = write_certificates(tmp_path, ["localhost"], force=True)
    assert forced.ca_created
    assert (tmp_path / "ca.crt").read_bytes() != ca_before


def test_a_ca_key_without_its_certificate_is_refused(tmp_path):
    write_certificates(tmp_path, ["localhost"])
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(CertificateError, match="ca.key exists without"):
        write_certificates(tmp_path, ["localhost"])


def test_a_ca_certificate_without_its_key_is_refused(tmp_path):
    write_certificates(tmp_path, ["localhost"])
    (tmp_path / "ca.key").unlink()
    with pytest.raises(CertificateError, match="does not exist.*--force"):
        write_certificates(tmp_path, ["localhost"])


def test_separate_ca_dir_keeps_the_ca_key_out_of_the_output(tmp_path):
    write_certificates(tmp_path / "out", ["localhost"], ca_dir=tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").exists()
    assert not (tmp_path / "out" / "ca.key").exists()
    assert (tmp_path / "out" / "ca.crt").exists()


@pytest.mark.parametrize("bad", ["has space", "http://x", ""])
def test_bad_hostnames_are_refused_before_writing(tmp_path, bad):
    with pytest.raises(InvalidArgument):
        write_certificates(tmp_path, [bad])
    assert not any(tmp_path.iterdir())
