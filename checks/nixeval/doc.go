// Package nixeval tests the Nix front door without NixOS: it evaluates the
// services.nixcage module with lib.evalModules against a real nixpkgs lib
// (NIXPKGS_LIB, a checkout of nix-community/nixpkgs.lib), feeds the JSON the
// module renders to the same cagectl the NixOS build runs, checks that every
// assertion fires on the declaration written to trip it, that the Nix and HCL
// examples render byte-identical trees, that the flake exposes what it
// should, and that nix/vendor.json's vendorHash matches the vendor tree.
//
// The package holds only tests. They skip with a printed reason when
// nix-instantiate or the nixpkgs lib checkout is missing.
package nixeval
