# A credential host covered by a wildcard inspect pattern passes the
# secret-not-inspected assertion (as it passes cagectl validate).
{
  services.nixcage = {
    enable = true;
    egressPolicies.web = { allow = [ "*.example.com" ]; inspect = [ "*.example.com" ]; };
    agents.a = {
      backend = "service";
      command = [ "/bin/true" ];
      egress = "web";
      secrets.api = { source = "/run/secrets/api"; env = "API_KEY"; hosts = [ "api.example.com" ]; };
    };
  };
}
