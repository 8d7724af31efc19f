// Package version is the one place nixcage's version lives. Every binary
// reports it (cagectl --version, caged --version and its Version property,
// cage-egress --version); builds stamp it with
//
//	go build -ldflags "-X github.com/nixcage/nixcage/internal/version.Version=0.1.0" ./cmd/...
//
// (nix/package.nix does; an unstamped build says "dev").
package version

// Version is set at link time.
var Version = "dev"
