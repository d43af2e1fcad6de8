//! A development certificate for the HTTP port, so that the SDKs' administration clients, which
//! only speak https, work against a local server with configuration alone: the server makes a
//! CA once, signs a certificate for its host names with it, forgets the CA's key, and keeps the
//! three files in a directory. A client trusts `ca.pem` (Python: `REQUESTS_CA_BUNDLE`, Node:
//! `NODE_EXTRA_CA_CERTS`).
//!
//! Since the CA's key is never kept, trusting `ca.pem` trusts this one certificate and nothing
//! else it could sign later.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// Why the development certificate could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum DevTlsError {
    /// The directory or a file in it could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A certificate could not be made (a host name that is not a valid DNS name or address).
    #[error("making the development certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// The development certificate kept in a directory: `ca.pem` (what clients trust), `cert.pem`
/// and `key.pem` (the server's, the key readable by its owner only), and `names` (the host
/// names the certificate was made for, written last: a directory without it, or with other
/// names, is made again).
#[derive(Clone, Debug)]
pub struct DevCertificate {
    /// The CA file clients trust.
    pub ca_file: PathBuf,
    /// The server's certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// The server's private key, PEM.
    pub key_pem: Vec<u8>,
    /// Whether this call made it (false: it was already there).
    pub created: bool,
}

impl DevCertificate {
    /// Loads the certificate kept in `dir` when it was made for `names`; otherwise makes a new
    /// one (and a new CA) for them. `names` are DNS names or IP addresses.
    ///
    /// # Errors
    ///
    /// [`DevTlsError::Io`] when `dir` cannot be created, read or written;
    /// [`DevTlsError::Generate`] when a name is not valid in a certificate.
    pub fn load_or_create(dir: &Path, names: &[String]) -> Result<Self, DevTlsError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| DevTlsError::Io { path, source }
        };
        let wanted = names.join("\n") + "\n";
        let ca_file = dir.join("ca.pem");
        let (cert_file, key_file, names_file) =
            (dir.join("cert.pem"), dir.join("key.pem"), dir.join("names"));
        if std::fs::read_to_string(&names_file).ok().as_deref() == Some(wanted.as_str()) {
            let cert_pem = std::fs::read(&cert_file).map_err(io(&cert_file))?;
            let key_pem = std::fs::read(&key_file).map_err(io(&key_file))?;
            if ca_file.is_file() {
                return Ok(Self { ca_file, cert_pem, key_pem, created: false });
            }
        }
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.distinguished_name.push(DnType::CommonName, "twice serve development CA");
        let ca_key = KeyPair::generate()?;
        let ca = ca.self_signed(&ca_key)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name.push(DnType::CommonName, "twice serve");
        let cert = params.signed_by(&key, &ca, &ca_key)?;
        let (cert_pem, key_pem) = (cert.pem().into_bytes(), key.serialize_pem().into_bytes());
        // `names` last: until it is written, a crash leaves a directory that is made again.
        let _ = std::fs::remove_file(&names_file);
        write_file(&key_file, &key_pem, 0o600).map_err(io(&key_file))?;
        write_file(&cert_file, &cert_pem, 0o644).map_err(io(&cert_file))?;
        write_file(&ca_file, ca.pem().as_bytes(), 0o644).map_err(io(&ca_file))?;
        write_file(&names_file, wanted.as_bytes(), 0o644).map_err(io(&names_file))?;
        Ok(Self { ca_file, cert_pem, key_pem, created: true })
    }
}

/// Writes `bytes` to `path` through a temporary file renamed over it, with `mode`, durably.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()]
    }

    #[test]
    fn made_once_then_loaded_and_made_again_for_other_names() {
        let dir = tempfile::tempdir().unwrap();
        let first = DevCertificate::load_or_create(dir.path(), &names()).unwrap();
        assert!(first.created);
        let again = DevCertificate::load_or_create(dir.path(), &names()).unwrap();
        assert!(!again.created);
        assert_eq!(again.cert_pem, first.cert_pem);
        let ca = std::fs::read(&first.ca_file).unwrap();
        let mut other = names();
        other.push("box.lan".to_owned());
        let remade = DevCertificate::load_or_create(dir.path(), &other).unwrap();
        assert!(remade.created);
        assert_ne!(std::fs::read(&remade.ca_file).unwrap(), ca, "a new CA for new names");
    }

    #[test]
    fn the_key_is_its_owners_alone_and_a_torn_directory_is_made_again() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let first = DevCertificate::load_or_create(dir.path(), &names()).unwrap();
        let mode = std::fs::metadata(dir.path().join("key.pem")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A crash before `names` was written: everything is made again.
        std::fs::remove_file(dir.path().join("names")).unwrap();
        let remade = DevCertificate::load_or_create(dir.path(), &names()).unwrap();
        assert!(remade.created);
        assert_ne!(remade.cert_pem, first.cert_pem);
    }

    #[test]
    fn a_name_a_certificate_cannot_hold_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            DevCertificate::load_or_create(dir.path(), &["bücher.example".to_owned()]).unwrap_err();
        assert!(matches!(err, DevTlsError::Generate(_)), "{err}");
    }
}
