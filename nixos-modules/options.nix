# services.nixcage options. This file needs nothing but `lib`, so the model
# and the assertions can be evaluated (and tested) with lib.evalModules alone.
#
# Every option that has a default in the Go schema defaults to null here and
# is left out of the rendered JSON: the defaults live in one place
# (internal/config) and `cagectl validate` fills them in.
{ lib, ... }:
let
  inherit (lib) mkOption mkEnableOption types;

  nullOr = t: mkOption {
    type = types.nullOr t;
    default = null;
  };
  opt = t: description: (nullOr t) // { inherit description; };

  # The value type of pkgs.formats.json, rebuilt from lib so that `settings`
  # type-checks without pkgs (RFC 42).
  jsonValue = types.nullOr (
    types.oneOf [
      types.bool
      types.int
      types.float
      types.str
      types.path
      (types.attrsOf jsonValue)
      (types.listOf jsonValue)
    ]
  ) // { description = "JSON value"; };

  hostList = description: mkOption {
    type = types.listOf types.str;
    default = [ ];
    example = [ "api.example.com" "*.example.org" ];
    inherit description;
  };

  policyModule = { ... }: {
    options = {
      allow = hostList "Host patterns the agent may reach (exact names or `*.suffix`). Everything else is denied.";
      deny = hostList "Host patterns that are always refused; deny wins over allow.";
      inspect = hostList "Allowed hosts whose TLS the gateway terminates with the cage CA, so inspectors see requests and credentials can be injected.";
      ports = opt (types.listOf types.port) "Ports CONNECT may reach (default [ 443 ]).";
      rateLimit = opt (types.submodule {
        options = {
          perSecond = mkOption {
            type = types.either types.ints.positive types.float;
            description = "Requests per second per host.";
          };
          burst = opt types.ints.positive "Token bucket size (default: perSecond).";
        };
      }) "Per-host token bucket.";
      inspectors = mkOption {
        default = { };
        description = "Inspector settings by name (real_values, secret_patterns, body_size, entropy, encoded_blobs).";
        type = types.attrsOf (types.submodule {
          options = {
            action = mkOption {
              type = types.enum [ "flag" "block" ];
              description = "What a finding does.";
            };
            threshold = opt types.float "Entropy threshold in bits per byte.";
            maxBytes = opt types.ints.positive "Body size limit.";
            minLength = opt types.ints.positive "Shortest blob reported.";
          };
        });
      };
      limits = opt (types.submodule {
        options = {
          maxTunnels = opt types.ints.positive "Concurrent CONNECT tunnels.";
          maxHeaderBytes = opt types.ints.positive "Request header size limit.";
          maxBodyBytes = opt types.ints.positive "Request body size limit.";
          idleTimeout = opt types.str "Idle timeout, a Go duration such as \"5m\".";
        };
      }) "Connection limits.";
      dns = opt (types.submodule {
        options = {
          enabled = opt types.bool "Answer DNS for allowed names (default true).";
          allowTypes = opt (types.listOf types.str) "Record types answered for allowed names (default A, AAAA, CNAME, HTTPS).";
          denyTypes = opt (types.listOf types.str) "Record types refused even for allowed names.";
          maxLabelLength = opt types.ints.positive "Longest DNS label answered.";
        };
      }) "The cage's DNS filter.";
      credentials = mkOption {
        default = { };
        description = "Where a named credential may be sent, so an agent's secret of that name needs only source and env.";
        type = types.attrsOf (types.submodule {
          options = {
            hosts = mkOption {
              type = types.listOf types.str;
              description = "Exact host names the real value is injected for.";
            };
            header = opt types.str "Header carrying the credential (default Authorization).";
          };
        });
      };
      websocket = opt types.bool "Allow WebSocket on intercepted hosts, every message inspected and redacted (default true).";
      httpRules = mkOption {
        default = { };
        description = "Method and path rules on intercepted hosts, by name; deny wins, and a host named by any allow rule needs a matching one.";
        type = types.attrsOf (types.submodule {
          options = {
            hosts = mkOption {
              type = types.listOf types.str;
              description = "Intercepted host patterns the rule applies to.";
            };
            methods = opt (types.listOf types.str) "Methods matched (default: any); WEBSOCKET matches handshakes.";
            paths = opt (types.listOf types.str) "Paths matched: \"/exact\" or \"/prefix/*\" (default: any).";
            action = mkOption {
              type = types.enum [ "allow" "deny" ];
              description = "What a match does.";
            };
          };
        });
      };
      unsafeAllowLoopbackUpstreams = opt types.bool "Let the gateway dial loopback addresses. Tests only.";
      unsafeAllowPrivateUpstreams = opt types.bool "Let the gateway dial private (RFC 1918, ULA) addresses.";
    };
  };

  secretModule = { name, ... }: {
    options = {
      source = mkOption {
        type = types.str;
        example = "/run/secrets/anthropic";
        description = ''
          Path of the file holding the real value on the host, read by systemd
          with LoadCredential= for the egress gateway only; the cage sees a
          placeholder. A string, not a Nix path, so the secret never enters
          the Nix store: use `config.sops.secrets.NAME.path` (sops-nix) or
          `config.age.secrets.NAME.path` (agenix).
        '';
      };
      env = (opt types.str "Variable holding the placeholder inside the cage (default: the variable the agent's harness reads, for the harness's own secret; required otherwise).") // { example = "ANTHROPIC_API_KEY"; };
      hosts = opt (types.listOf types.str) "Exact hosts the real value is injected for (default: the policy's credential \"${name}\").";
      header = opt types.str "Header carrying the value (default: the policy's, else Authorization).";
    };
  };

  agentModule = { name, ... }: {
    options = {
      backend = opt (types.enum [ "service" "nspawn" "podman" ]) "What runs the agent: a hardened systemd service, systemd-nspawn, or podman (default \"service\").";
      command = mkOption {
        type = types.nonEmptyListOf types.str;
        example = [ "/nix/tools/bin/claude" ];
        description = "argv of the agent, as seen inside the cage (no PATH lookup).";
      };
      environment = mkOption {
        type = types.attrsOf types.str;
        default = { };
        description = "Extra environment of the agent. No secrets here: they would land in the Nix store.";
      };
      workspace = opt types.str "The agent's writable directory, below /var/lib (default /var/lib/nixcage/agents/${name}).";
      tools = opt types.str "Tool profile in the shared store (default: the current generation).";
      image = opt types.str "Container image (podman only).";
      autostart = opt types.bool "Start with nixcage.target (default true).";
      interactive = opt types.bool "Give the agent a terminal held by caged; `cagectl attach NAME` connects to it (default false).";
      learn = opt types.bool "Learn mode: for learnFor after each start of the cage, requests outside the policy are allowed and flagged (audit rule learn), never private/metadata addresses, IP literals or denied names; `cagectl policy suggest` turns the run into a policy (docs/grants.md). Default false.";
      learnFor = opt types.str "Length of the learn window, 1m to 24h (default 30m). Needs learn = true.";
      turnCommand = opt (types.nonEmptyListOf types.str) "argv of one turn (cagectl say, a chat message; docs/relay.md), run in the agent's cage with the text on its stdin; the first word an absolute path inside the cage. Default: the harness's (claude-code: claude -p --continue; codex: codex exec resume --last ... -), none otherwise.";
      turnTimeout = opt types.str "How long one turn may run before it is stopped, 1s to 24h (default 10m).";
      approval = opt (types.submodule {
        options = {
          wait = opt types.str "How long a request outside the policy waits for `cagectl approve` (1s to 5m, default 30s).";
          maxPending = opt types.ints.positive "Distinct requests waiting at once; more are refused at once (1 to 32, default 4).";
        };
      }) "Approval queue: requests outside the policy wait for an operator (docs/grants.md).";
      egress = opt types.str "Name of an egress policy: one of services.nixcage.egressPolicies or a shipped one (claude-code, codex, gemini, github, none). Default: the harness's policy, else \"none\" (deny all).";
      harness = opt types.str "A shipped harness scaffold (claude-code, codex, gemini; docs/harnesses.md): its policy, the variable its CLI reads the key from, its environment and the cage note. Checked by cagectl validate.";
      egressPolicy = opt (types.submodule policyModule) "An egress policy for this agent alone, instead of `egress`.";
      secrets = mkOption {
        type = types.attrsOf (types.submodule secretModule);
        default = { };
        description = "Credentials held by the agent's egress gateway.";
      };
      resources = opt (types.submodule {
        options = {
          memory = opt types.str "MemoryMax= (default 2G).";
          cpu = opt types.str "CPUQuota=, e.g. \"150%\".";
          tasks = opt types.ints.positive "TasksMax= (default 512).";
        };
      }) "cgroup limits of the cage.";
    };
  };
in
{
  options.services.nixcage = {
    enable = mkEnableOption "nixcage, cages for untrusted AI agents";

    configFile = opt types.path ''
      An HCL (or HCL-JSON) configuration used instead of the options below;
      it is validated and rendered at build time exactly like a declared one.
    '';

    agents = mkOption {
      type = types.attrsOf (types.submodule agentModule);
      default = { };
      description = "Agents, one cage each. Names are 1-24 characters of a-z, 0-9 and '-'.";
    };

    egressPolicies = mkOption {
      type = types.attrsOf (types.submodule policyModule);
      default = { };
      description = "Named egress policies agents refer to with `egress`.";
    };

    accounts = mkOption {
      default = { };
      description = "Who may talk to caged over D-Bus, and with which role.";
      type = types.attrsOf (types.submodule {
        options = {
          user = opt types.str "Unix user (exactly one of user, group).";
          group = opt types.str "Unix group (exactly one of user, group).";
          role = mkOption {
            type = types.enum [ "viewer" "operator" "admin" ];
            description = "viewer reads status; operator starts, stops, kills, quarantines; admin also applies and rolls back releases.";
          };
          agents = opt (types.listOf types.str) "Agents covered (default: all).";
        };
      });
    };

    store = opt (types.submodule {
      options = {
        root = opt types.str "Shared store root (default /var/lib/nixcage/store).";
        channel = mkOption {
          type = types.str;
          example = "stable";
          description = "Release channel the store follows.";
        };
        keys = mkOption {
          type = types.listOf types.str;
          description = "PEM public keys (paths on the host) releases must be signed with.";
        };
        nixKeys = opt (types.listOf types.str) "Nix binary cache public keys (name:base64).";
        threshold = opt types.ints.positive "Distinct keys that must have signed (default 1).";
        generations = opt types.ints.positive "Store generations kept (default 3).";
        rootKeys = opt (types.listOf types.str) "PEM public root keys (paths on the host) that sign key rotations (keys/N.json); empty: no rotation.";
        rootThreshold = opt types.ints.positive "Distinct root keys that must sign a key rotation (default 1).";
        expiryWarning = opt types.str "Report the current generation as expiring this long before its release expires: days (\"7d\") or a duration (\"36h\"); default 7d.";
      };
    }) "The shared read-only tool store and release trust.";

    evidence = opt (types.submodule {
      options = {
        maxBytes = opt types.ints.positive "Workspace file content copied per quarantine, holes included (default 1073741824); what is cut is named in omitted.txt.";
        maxEntries = opt types.ints.positive "Workspace entries looked at per quarantine (default 100000).";
        maxDuration = opt types.str "Time limit of a quarantine's workspace copy, a duration such as \"2m\" (default 2m).";
      };
    }) "Bounds of each quarantine's evidence copy (docs/operations.md).";

    relay = opt (types.submodule {
      options = {
        tokenFile = mkOption {
          type = types.str;
          example = "/run/secrets/telegram-bot-token";
          description = "Host path of the Telegram bot token, loaded into cage-relay.service with LoadCredential= (keep it out of the Nix store).";
        };
        owners = mkOption {
          type = types.listOf types.ints.positive;
          example = [ 123456789 ];
          description = "Telegram user ids whose commands the relay carries out; everyone else is refused and audited.";
        };
        account = mkOption {
          type = types.str;
          example = "relay";
          description = "The account (services.nixcage.accounts) the relay calls caged as; its user must be \"cage-relay\". Its role and agents bound what any chat command can do.";
        };
        apiUrl = opt types.str "Bot API server: https, or http to loopback only (default https://api.telegram.org).";
        maxFileBytes = opt types.ints.positive "Largest file the relay moves in either direction (default 20971520, the Bot API's download limit).";
        chats = mkOption {
          default = { };
          description = "Per agent, the chat it answers in: a group, or one topic of a forum group.";
          type = types.attrsOf (types.submodule {
            options = {
              chatId = mkOption {
                type = types.int;
                example = -1001234567890;
                description = "The chat's id (groups are negative).";
              };
              topic = opt types.ints.positive "Forum topic id (message_thread_id); unset for the whole chat.";
            };
          });
        };
      };
    }) "The Telegram chat relay, cage-relay (docs/relay.md); off when null.";

    metrics = opt (types.submodule {
      options = {
        listen = opt types.str "Where caged serves Prometheus metrics: a loopback \"HOST:PORT\" or \"unix:/run/nixcage/NAME\" (default 127.0.0.1:9477).";
      };
    }) "Serve Prometheus metrics from caged (docs/fleet.md); off when null. Set to { } for the default address.";

    control = opt (types.submodule {
      options = {
        hostId = opt types.str "This host's id, which a control command's host must name (default: the host name).";
        keys = mkOption {
          type = types.listOf types.str;
          description = "PEM public keys (paths on the host) control commands must be signed with; keep them apart from store.keys.";
        };
        threshold = opt types.ints.positive "Distinct control keys that must have signed a command (default 1).";
        ackUrl = opt types.str "http(s) URL every acknowledgement is PUT below (HOST/SHA256/STATUS.json); unset: acks stay in the file and the journal.";
      };
    }) "Accept signed control commands (docs/fleet.md, \"Control commands\"); none are accepted when null.";

    channel = opt (types.submodule {
      options = {
        url = opt types.str "The release channel's base URL (http:// or https://; any static server, docs/fleet.md \"Channels\"). Required when the block is set.";
        interval = opt types.str "How often caged polls the channel, a duration such as \"5m\" (default 5m, at least 1s); failures back off from it, with jitter.";
        caFile = opt types.str "PEM CA bundle (a path on the host) that replaces the system's CAs for an https channel; default: the system's.";
      };
    }) "Poll a release channel for newer signed releases (docs/fleet.md); off when null. Needs services.nixcage.store.";

    settings = mkOption {
      type = types.submodule { freeformType = types.attrsOf jsonValue; };
      default = { };
      description = ''
        Escape hatch (RFC 42): merged over the JSON rendered from the options
        above, in the HCL-JSON shape of docs/config.md (snake_case keys), for
        schema fields this module does not declare yet.
      '';
      example = { agent.alice.tools = "claude-1.0"; };
    };

    # Computed by model.nix; read-only so nobody sets it by accident.
    model = mkOption {
      type = types.attrsOf types.anything;
      readOnly = true;
      internal = true;
      description = "The configuration as HCL-JSON, what `cagectl validate` checks.";
    };
    checks = mkOption {
      type = types.listOf types.attrs;
      readOnly = true;
      internal = true;
      description = "Assertions computed from the declaration ({ id, assertion, message }).";
    };
  };
}
