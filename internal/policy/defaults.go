package policy

// Defaults of the egress policy model, defined here once: the config
// validator writes them into every rendered runtime document, and the
// gateway applies the same values where a document leaves a field at zero
// (hand-written documents, tests). docs/config.md and docs/egress.md quote
// them; TestDocsQuoteDefaults holds the docs to these numbers.
const (
	// DefaultMaxTunnels bounds what the cage can make the gateway hold at
	// once: CONNECT tunnels, plain-HTTP connections and HTTP/2 streams on
	// intercepted connections all count against it (one cap, every path).
	DefaultMaxTunnels         = 256
	DefaultMaxHeaderBytes     = 64 << 10
	DefaultMaxBodyBytes       = 32 << 20
	DefaultIdleTimeoutSeconds = 300
	// DefaultRatePerSecond and DefaultRateBurst are the per-host token
	// bucket of a rendered policy (a zero rate in a document disables it).
	DefaultRatePerSecond = 20.0
	DefaultRateBurst     = 40
	// Inspector parameters.
	DefaultEntropyBits      = 4.5
	DefaultEntropyMinLength = 32
	DefaultBlobMinLength    = 512
	// DefaultMaxLabelLength is DNS's own limit: no extra cap.
	DefaultMaxLabelLength = 63
)

// DefaultDNSAllowTypes are the record types the cage's resolver answers:
// addresses (A, AAAA), the aliases inside their answers (CNAME) and the
// HTTPS records newer clients (curl, browsers' resolvers) ask for first.
// TXT, MX, SRV and the rest carry more data per answer and nothing an
// agent behind the proxy needs; a policy lists them if it does.
var DefaultDNSAllowTypes = []string{"A", "AAAA", "CNAME", "HTTPS"}

// DefaultDNSDenyTypes are refused even for allowed names: zone transfers and
// ANY only help enumeration and amplification.
var DefaultDNSDenyTypes = []string{"ANY", "AXFR", "IXFR"}
