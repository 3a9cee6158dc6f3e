//! TLS to Postgres, as libpq's `sslmode` and `sslrootcert` in the database URL ask for it
//! (managed Postgres services often refuse plain connections). Without them, or with
//! `disable`, `allow` or `prefer`, connections stay plain TCP: pitcrew never negotiates TLS
//! nobody asked for, since every statement of a busy crew would pay for it.

use super::StoreError;
use crate::config::redact_url;
use postgres_native_tls::MakeTlsConnector;
use tokio_postgres::config::SslMode;

/// What the URL's `sslmode` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// `disable`, `allow`, `prefer`, or no `sslmode`: plain TCP.
    Off,
    /// `require`: encrypted. As with libpq, the server's certificate is checked (as for
    /// `verify-ca`) only when `sslrootcert` names the authorities to trust.
    Require,
    /// `verify-ca`: a certificate signed by an authority of `sslrootcert`, else of the system's.
    VerifyCa,
    /// `verify-full`: that, and issued for the host connected to.
    VerifyFull,
}

/// A database URL read for tokio-postgres, and the TLS it asks for.
pub struct Target {
    pub config: tokio_postgres::Config,
    pub tls: MakeTlsConnector,
    pub mode: TlsMode,
}

/// Read `url` (`postgres://...` or `host=... dbname=...`): its TLS parameters by libpq's
/// meaning, the rest by tokio-postgres.
pub fn target(url: &str) -> Result<Target, StoreError> {
    let bad = |why: String| StoreError::Config(format!("bad database URL {}: {why}", redact_url(url)));
    let (rest, mode, root) = split_tls_params(url).map_err(bad)?;
    let mut config: tokio_postgres::Config = rest.parse().map_err(|e| bad(super::said_with_causes(&e)))?;
    // Redacted by its value from here on, wherever it shows (a client's error that quotes it).
    if let Some(password) = config.get_password() {
        let _ = pitcrew_model::redact::register_secret(&String::from_utf8_lossy(password));
    }
    // Every `sslmode` read above is gone from `rest`: one tokio-postgres still finds was written
    // where this reading missed it (`sslmode = require`, an escaped key, a `?` in the password),
    // and overriding it could turn a TLS the URL asks for into plain TCP.
    if config.get_ssl_mode() != SslMode::Prefer {
        return Err(bad("its sslmode is written where pitcrew cannot read it: write `sslmode=<mode>` \
                        (in a URL, after the `?` that starts its parameters)"
            .into()));
    }
    // As libpq: no TLS over Unix-domain sockets (nothing leaves the machine), whatever sslmode
    // says, so `host=/var/run/postgresql sslmode=verify-full` connects as psql would. Only when
    // every connection is to a socket: with a `hostaddr`, tokio-postgres connects over TCP to it
    // whatever `host` says, and a list mixing sockets and TCP hosts keeps TLS for all of them.
    let hosts = config.get_hosts();
    let sockets_only = !hosts.is_empty()
        && config.get_hostaddrs().is_empty()
        && hosts.iter().all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
    let mode = if sockets_only { TlsMode::Off } else { mode };
    if mode == TlsMode::VerifyCa && root.is_none() {
        // Any authority the system trusts, and any name: anyone with any public certificate
        // would pass. libpq asks for the authority too.
        return Err(bad("sslmode=verify-ca needs sslrootcert (the authority that signs the server's \
                        certificate); to trust the system's authorities, use verify-full"
            .into()));
    }
    config.ssl_mode(if mode == TlsMode::Off { SslMode::Disable } else { SslMode::Require });
    // A root certificate means nothing without TLS: not read then.
    let tls = connector(mode, root.as_deref().filter(|_| mode != TlsMode::Off)).map_err(bad)?;
    Ok(Target { config, tls, mode })
}

fn mode_of(value: &str) -> Result<TlsMode, String> {
    match value {
        "disable" | "allow" | "prefer" => Ok(TlsMode::Off),
        "require" => Ok(TlsMode::Require),
        "verify-ca" => Ok(TlsMode::VerifyCa),
        "verify-full" => Ok(TlsMode::VerifyFull),
        other => {
            Err(format!("sslmode '{other}' is not one of disable, allow, prefer, require, verify-ca, verify-full"))
        }
    }
}

/// The URL without `sslmode` and `sslrootcert` (tokio-postgres knows only three of the modes
/// and no root certificate), and what they said.
fn split_tls_params(url: &str) -> Result<(String, TlsMode, Option<String>), String> {
    let (mut mode, mut root) = (TlsMode::Off, None);
    let mut take = |key: &str, value: String| -> Result<bool, String> {
        match key {
            "sslmode" => mode = mode_of(&value)?,
            "sslrootcert" if value.is_empty() => return Err("sslrootcert is empty".into()),
            "sslrootcert" => root = Some(value),
            _ => return Ok(true),
        }
        Ok(false)
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_string(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    if take(key, crate::bus::percent_decode(value))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else if !url.split_whitespace().any(|pair| pair.starts_with("sslmode=") || pair.starts_with("sslrootcert=")) {
        // Left as written: rejoining its words would fold the spaces inside a quoted value.
        url.to_string()
    } else {
        let mut kept = Vec::new();
        for pair in url.split_whitespace() {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if (key == "sslmode" || key == "sslrootcert") && value.starts_with('\'') {
                return Err(format!("{key}: write its value without quotes"));
            }
            if take(key, value.to_string())? {
                kept.push(pair);
            }
        }
        kept.join(" ")
    };
    Ok((rest, mode, root))
}

/// The TLS client for `mode`, trusting the authorities of the PEM file `root` (alone) when given.
fn connector(mode: TlsMode, root: Option<&str>) -> Result<MakeTlsConnector, String> {
    let mut b = native_tls::TlsConnector::builder();
    if let Some(path) = root {
        let pem = std::fs::read(path).map_err(|e| format!("sslrootcert {path}: {e}"))?;
        let certs = native_tls::Certificate::stack_from_pem(&pem).map_err(|e| format!("sslrootcert {path}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("sslrootcert {path}: no certificate in it"));
        }
        for cert in certs {
            b.add_root_certificate(cert);
        }
        b.disable_built_in_roots(true);
    }
    match (mode, root) {
        (TlsMode::Require, None) => {
            b.danger_accept_invalid_certs(true).danger_accept_invalid_hostnames(true);
        }
        (TlsMode::Require, Some(_)) | (TlsMode::VerifyCa, _) => {
            b.danger_accept_invalid_hostnames(true);
        }
        (TlsMode::VerifyFull, _) | (TlsMode::Off, _) => {}
    }
    let tls = b.build().map_err(|e| format!("TLS set-up: {e}"))?;
    Ok(MakeTlsConnector::new(tls))
}

/// A connection that failed in its TLS handshake (a certificate not trusted, a server without
/// TLS): a setting to fix, not an outage to wait out. A handshake cut by the network (a proxy
/// restarting, a reset) is an outage: an I/O error under it says so.
pub(crate) fn is_tls_failure(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    let mut tls = false;
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return false;
        }
        if let Some(t) = s.downcast_ref::<native_tls::Error>() {
            // OpenSSL's word for a peer that closed mid-handshake (a proxy restarting, a
            // balancer without backends): no I/O error under it, but an outage all the same.
            if t.to_string().to_ascii_lowercase().contains("unexpected eof") {
                return false;
            }
            tls = true;
        }
        source = s.source();
    }
    if tls {
        return true;
    }
    // tokio-postgres has no public kind for its own TLS errors (a server that answers it has
    // no TLS): its message is all there is.
    e.to_string().starts_with("error performing TLS handshake")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(url: &str) -> (String, TlsMode, Option<String>) {
        split_tls_params(url).unwrap()
    }

    #[test]
    fn tls_parameters_are_read_as_libpq_reads_them_and_the_rest_left_to_tokio_postgres() {
        assert_eq!(split("postgres://u@db/p"), ("postgres://u@db/p".into(), TlsMode::Off, None));
        assert_eq!(
            split("postgres://u@db/p?connect_timeout=3&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem"),
            ("postgres://u@db/p?connect_timeout=3".into(), TlsMode::VerifyFull, Some("/etc/ca.pem".into()))
        );
        assert_eq!(
            split("postgresql://u@db/p?sslmode=require"),
            ("postgresql://u@db/p".into(), TlsMode::Require, None)
        );
        for off in ["disable", "allow", "prefer"] {
            assert_eq!(split(&format!("postgres://db/p?sslmode={off}")).1, TlsMode::Off, "{off}");
        }
        assert_eq!(
            split("host=db dbname=p sslmode=verify-ca sslrootcert=/ca.pem user=u"),
            ("host=db dbname=p user=u".into(), TlsMode::VerifyCa, Some("/ca.pem".into()))
        );
        let e = split_tls_params("postgres://db/p?sslmode=verify").unwrap_err();
        assert!(e.contains("'verify'") && e.contains("verify-full"), "{e}");
        assert!(split_tls_params("host=db sslrootcert='/a b.pem'").unwrap_err().contains("without quotes"));
        assert!(split_tls_params("postgres://db/p?sslrootcert=").unwrap_err().contains("empty"));
        let spaced = "host=db application_name='two  spaces'";
        assert_eq!(split(spaced), (spaced.into(), TlsMode::Off, None), "no TLS words: as written");
    }

    #[test]
    fn a_url_is_read_whole_with_its_tls_and_a_bad_one_is_a_config_error_without_its_password() {
        let t = target("postgres://u:hunter2@db:5432/p?sslmode=require&application_name=crew").unwrap();
        assert_eq!((t.mode, t.config.get_ssl_mode()), (TlsMode::Require, SslMode::Require));
        assert_eq!(t.config.get_application_name(), Some("crew"));
        // No sslmode: plain, never `prefer` (which would negotiate TLS with a server that has it).
        assert_eq!(target("postgres://u@db/p").unwrap().config.get_ssl_mode(), SslMode::Disable);
        // TLS asked for where this reading misses it is refused, never taken for plain TCP.
        for missed in ["host=db user=u sslmode = require", "postgres://u:hunter2@db/p?ssl%6Dode=require"] {
            let e = target(missed).err().expect(missed);
            assert!(e.to_string().contains("cannot read"), "{e}");
        }
        // A root certificate is read only for TLS.
        assert!(target("postgres://db/p?sslmode=disable&sslrootcert=/no/such.pem").is_ok());
        // None over Unix-domain sockets, as with libpq, whatever the mode; a TCP host keeps it.
        for socket in [
            "host=/var/run/postgresql dbname=p sslmode=verify-ca",
            "postgresql://u@%2Fvar%2Frun%2Fpostgresql/p?sslmode=verify-full&sslrootcert=/no/such.pem",
        ] {
            let t = target(socket).unwrap_or_else(|e| panic!("{socket}: {e}"));
            assert_eq!((t.mode, t.config.get_ssl_mode()), (TlsMode::Off, SslMode::Disable), "{socket}");
        }
        let mixed = target("host=/var/run/postgresql,db dbname=p sslmode=require").unwrap();
        assert_eq!(mixed.mode, TlsMode::Require);
        // A socket path with an address is a TCP connection to the address.
        let addressed = target("host=/var/run/postgresql hostaddr=10.0.0.5 dbname=p sslmode=require").unwrap();
        assert_eq!((addressed.mode, addressed.config.get_ssl_mode()), (TlsMode::Require, SslMode::Require));
        for bad in [
            "postgres://u:hunter2@db/p?sslmode=always",
            "postgres://u:hunter2@db/p?sslmode=require&sslrootcert=/no/such.pem",
            "postgres://u:hunter2@db/p?sslmode=verify-ca",
        ] {
            let e = target(bad).err().expect(bad);
            assert!(matches!(e, StoreError::Config(_)) && !e.is_transient(), "{e:?}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
