package release

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
)

// Key algorithms a release may be signed with. Only these two are accepted
// on either side, so a trusted-key file can never silently bring in RSA or
// a weak curve.
const (
	AlgEd25519   = "ed25519"
	AlgECDSAP256 = "ecdsa-p256"
)

// GenerateKey returns a new key pair as PKCS#8 / PKIX PEM.
func GenerateKey(alg string) (privPEM, pubPEM []byte, err error) {
	var priv crypto.Signer
	switch alg {
	case AlgEd25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, nil, err
		}
		priv = k
	case AlgECDSAP256:
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, nil, err
		}
		priv = k
	default:
		return nil, nil, fmt.Errorf("unknown key type %q: use %s or %s", alg, AlgEd25519, AlgECDSAP256)
	}
	privPEM, err = cryptoutils.MarshalPrivateKeyToPEM(priv)
	if err != nil {
		return nil, nil, fmt.Errorf("encode private key: %w", err)
	}
	pubPEM, err = cryptoutils.MarshalPublicKeyToPEM(priv.Public())
	if err != nil {
		return nil, nil, fmt.Errorf("encode public key: %w", err)
	}
	return privPEM, pubPEM, nil
}

// PublicKey is a trusted release key.
type PublicKey struct {
	ID  string // KeyID of Key
	Alg string
	Key crypto.PublicKey
	v   signature.Verifier
}

// PrivateKey signs releases.
type PrivateKey struct {
	ID  string
	Alg string
	s   signature.Signer
	pub *PublicKey
}

// Public is the key's public half.
func (k *PrivateKey) Public() *PublicKey { return k.pub }

// KeyID is the hex SHA-256 of the key's PKIX DER encoding: stable across
// PEM re-encodings and the same for a private key and its public half.
func KeyID(pub crypto.PublicKey) (string, error) {
	der, err := cryptoutils.MarshalPublicKeyToDER(pub)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(der)
	return hex.EncodeToString(sum[:]), nil
}

func keyAlg(pub crypto.PublicKey) (string, error) {
	switch k := pub.(type) {
	case ed25519.PublicKey:
		return AlgEd25519, nil
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() {
			return AlgECDSAP256, nil
		}
		return "", fmt.Errorf("ECDSA curve %s is not accepted: use P-256", k.Curve.Params().Name)
	}
	return "", fmt.Errorf("key type %T is not accepted: use %s or %s", pub, AlgEd25519, AlgECDSAP256)
}

// ParsePublicKey reads a PEM public key.
func ParsePublicKey(pemBytes []byte) (*PublicKey, error) {
	pub, err := cryptoutils.UnmarshalPEMToPublicKey(pemBytes)
	if err != nil {
		return nil, fmt.Errorf("parse public key: %w", err)
	}
	alg, err := keyAlg(pub)
	if err != nil {
		return nil, err
	}
	v, err := signature.LoadVerifier(pub, crypto.SHA256)
	if err != nil {
		return nil, fmt.Errorf("load verifier: %w", err)
	}
	id, err := KeyID(pub)
	if err != nil {
		return nil, err
	}
	return &PublicKey{ID: id, Alg: alg, Key: pub, v: v}, nil
}

// LoadPublicKey reads a PEM public key file.
func LoadPublicKey(path string) (*PublicKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read public key: %w", err)
	}
	k, err := ParsePublicKey(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return k, nil
}

// LoadPublicKeys reads several PEM public key files.
func LoadPublicKeys(paths []string) ([]*PublicKey, error) {
	var keys []*PublicKey
	for _, p := range paths {
		k, err := LoadPublicKey(p)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// ParsePrivateKey reads an unencrypted PKCS#8 (or SEC1 EC) PEM private key.
func ParsePrivateKey(pemBytes []byte) (*PrivateKey, error) {
	priv, err := cryptoutils.UnmarshalPEMToPrivateKey(pemBytes, nil)
	if err != nil {
		return nil, fmt.Errorf("parse private key: %w", err)
	}
	cs, ok := priv.(crypto.Signer)
	if !ok {
		return nil, errors.New("private key cannot sign")
	}
	alg, err := keyAlg(cs.Public())
	if err != nil {
		return nil, err
	}
	s, err := signature.LoadSigner(priv, crypto.SHA256)
	if err != nil {
		return nil, fmt.Errorf("load signer: %w", err)
	}
	pubPEM, err := cryptoutils.MarshalPublicKeyToPEM(cs.Public())
	if err != nil {
		return nil, err
	}
	pub, err := ParsePublicKey(pubPEM)
	if err != nil {
		return nil, err
	}
	return &PrivateKey{ID: pub.ID, Alg: alg, s: s, pub: pub}, nil
}

// LoadPrivateKey reads a PEM private key file.
func LoadPrivateKey(path string) (*PrivateKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read private key: %w", err)
	}
	k, err := ParsePrivateKey(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return k, nil
}
