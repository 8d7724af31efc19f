# Assertions computed from the declaration. Each names the option at fault
# and the fix. They catch at evaluation time, with NixOS option paths, what
# would otherwise surface later as a `cagectl validate` diagnostic pointing
# into a generated JSON file; the Go validator stays the authority and runs
# on the same data in the build (render.nix).
#
# Pure: needs only lib and config, so checks/nixeval evaluates it with
# lib.evalModules. default.nix turns services.nixcage.checks into NixOS
# `assertions`. Every id here has a declaration under
# checks/nixeval/testdata/trip/ that must trip it and nothing else.
{ lib, config, ... }:
let
  cfg = config.services.nixcage;
  opt = "services.nixcage";
  q = builtins.toJSON;

  # Policies shipped with nixcage (policies/*.hcl), by name.
  shipped = map (lib.removeSuffix ".hcl") (
    lib.attrNames (lib.filterAttrs (n: t: t == "regular" && lib.hasSuffix ".hcl" n) (builtins.readDir ../policies))
  );

  # Host pattern matching as internal/policy does it: exact, or "*.suffix"
  # matching any name below suffix.
  matches = pattern: host:
    pattern == host
    || (lib.hasPrefix "*." pattern && lib.hasSuffix (lib.removePrefix "*" pattern) host);
  matchesAny = patterns: host: lib.any (p: matches p host) patterns;

  podmanEnabled = lib.attrByPath [ "virtualisation" "podman" "enable" ] false config;

  agentChecks = name: a:
    let
      at = "${opt}.agents.${q name}";
      # The policy this agent uses, when it is declared in Nix (a shipped
      # policy is checked by cagectl validate in the build).
      policyName = if a.egress != null then a.egress else "none";
      policy =
        if a.egressPolicy != null then { name = "${at}.egressPolicy"; value = a.egressPolicy; }
        else if cfg.egressPolicies ? ${policyName} then { name = "${opt}.egressPolicies.${q policyName}"; value = cfg.egressPolicies.${policyName}; }
        else null;
      secretChecks = sname: s:
        let
          sat = "${at}.secrets.${q sname}";
          hosts =
            if s.hosts != null then s.hosts
            else if policy != null && policy.value.credentials ? ${sname} then policy.value.credentials.${sname}.hosts
            else [ ];
          notInspected = lib.filter (h: !(matchesAny policy.value.inspect h)) hosts;
        in
        [
          {
            id = "secret-in-store";
            assertion = !(lib.hasPrefix builtins.storeDir s.source);
            message = "${sat}.source = ${q s.source} is in the Nix store, which every local user can read. Keep the secret out of the store: point source at a runtime path such as config.sops.secrets.${sname}.path (sops-nix) or config.age.secrets.${sname}.path (agenix).";
          }
          {
            id = "secret-not-inspected";
            assertion = policy == null || notInspected == [ ];
            message = "${sat}: the gateway injects a credential only into requests it inspects, but ${lib.concatStringsSep ", " notInspected} ${if lib.length notInspected == 1 then "is" else "are"} not in ${if policy == null then "the policy" else policy.name}.inspect. Add ${lib.concatMapStringsSep ", " q notInspected} to ${if policy == null then "the policy's inspect list" else policy.name + ".inspect"} (and allow), or remove ${if lib.length notInspected == 1 then "it" else "them"} from ${sat}.hosts.";
          }
        ];
    in
    [
      {
        id = "agent-name";
        assertion = builtins.match "[a-z][a-z0-9-]{0,23}" name != null;
        message = "${at}: agent names become unit, user and directory names, so they are 1-24 characters of a-z, 0-9 and '-', starting with a letter. Rename the attribute.";
      }
      {
        id = "egress-both";
        assertion = a.egress == null || a.egressPolicy == null;
        message = "${at} sets both egress = ${q a.egress} and egressPolicy. Keep one: a named policy, or an inline one.";
      }
      {
        id = "egress-unknown";
        assertion = a.egressPolicy != null || cfg.egressPolicies ? ${policyName} || lib.elem policyName shipped;
        message = "${at}.egress = ${q policyName} names no policy. Declare ${opt}.egressPolicies.${q policyName}, or use a shipped one: ${lib.concatStringsSep ", " shipped}.";
      }
      {
        id = "podman-disabled";
        assertion = a.backend != "podman" || podmanEnabled;
        message = "${at}.backend = \"podman\" needs podman on the host. Set virtualisation.podman.enable = true, or use backend \"nspawn\" or \"service\".";
      }
    ]
    ++ lib.concatLists (lib.mapAttrsToList secretChecks a.secrets);

  accountChecks = name: a:
    let at = "${opt}.accounts.${q name}"; in
    [
      {
        id = "account-principal";
        assertion = (a.user == null) != (a.group == null);
        message = "${at} must set exactly one of user and group (it sets ${if a.user == null then "neither" else "both"}). Declare one account per user or group.";
      }
      {
        id = "account-agents";
        assertion = a.agents == null || lib.all (n: cfg.agents ? ${n}) a.agents;
        message = "${at}.agents names ${lib.concatStringsSep ", " (lib.filter (n: !(cfg.agents ? ${n})) (if a.agents == null then [ ] else a.agents))}, not declared in ${opt}.agents. Declare the agent or remove it from the list (leave agents unset to cover every agent).";
      }
    ];

  storeChecks = s: [
    {
      id = "store-threshold";
      assertion = s.threshold == null || s.threshold <= lib.length s.keys;
      message = "${opt}.store.threshold = ${toString s.threshold} but store.keys lists ${toString (lib.length s.keys)} key(s), so no release could ever be accepted. Lower the threshold or add keys.";
    }
    {
      id = "store-root-threshold";
      assertion = s.rootThreshold == null || s.rootThreshold <= lib.length (if s.rootKeys == null then [ ] else s.rootKeys);
      message = "${opt}.store.rootThreshold = ${toString s.rootThreshold} but store.rootKeys lists ${toString (lib.length (if s.rootKeys == null then [ ] else s.rootKeys))} key(s), so no key rotation could ever be accepted. Lower the threshold or add root keys.";
    }
  ];

  controlChecks = c: [
    {
      id = "control-threshold";
      assertion = c.threshold == null || c.threshold <= lib.length c.keys;
      message = "${opt}.control.threshold = ${toString c.threshold} but control.keys lists ${toString (lib.length c.keys)} key(s), so no control command could ever be accepted. Lower the threshold or add keys.";
    }
  ];

  declaresModel = cfg.agents != { } || cfg.egressPolicies != { } || cfg.accounts != { } || cfg.store != null || cfg.settings != { };
in
{
  config.services.nixcage.checks =
    [
      {
        id = "config-file-and-options";
        assertion = cfg.configFile == null || !declaresModel;
        message = "${opt}.configFile is set together with agents, egressPolicies, accounts, store or settings; the file would silently win. Use one: move the declarations into the file, or unset configFile.";
      }
    ]
    ++ lib.concatLists (lib.mapAttrsToList agentChecks cfg.agents)
    ++ lib.concatLists (lib.mapAttrsToList accountChecks cfg.accounts)
    ++ lib.optionals (cfg.store != null) (storeChecks cfg.store)
    ++ lib.optionals (cfg.control != null) (controlChecks cfg.control);
}
