// Package policies ships the reusable egress policies nixcage knows by name.
// A config's `egress = "claude-code"` resolves here when the config itself
// declares no policy of that name.
package policies

import "embed"

// FS holds every *.hcl file of this directory.
//
//go:embed *.hcl
var FS embed.FS
