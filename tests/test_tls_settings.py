"""TLS settings: a file that cannot be read, or a key without a certificate, stops start-up naming the variable."""

from tests.test_settings import django_setup


def test_an_unreadable_tls_file_stops_start_up_naming_the_variable(tmp_path):
    result = django_setup(LLMGW_HOME=str(tmp_path), LLMGW_TLS_CERT_FILE=str(tmp_path / "missing.pem"))
    assert result.returncode != 0
    assert f"LLMGW_TLS_CERT_FILE='{tmp_path / 'missing.pem'}' is not a readable file" in result.stderr


def test_a_key_without_a_certificate_stops_start_up(tmp_path):
    key = tmp_path / "key.pem"
    key.write_text("not checked here")
    result = django_setup(LLMGW_HOME=str(tmp_path), LLMGW_TLS_KEY_FILE=str(key))
    assert result.returncode != 0
    assert "LLMGW_TLS_KEY_FILE is set but LLMGW_TLS_CERT_FILE is not" in result.stderr
