# want: services.nixcage.agents."a".backend = "podman" needs podman on the host. Set virtualisation.podman.enable = true
{ services.nixcage.agents.a = { backend = "podman"; command = [ "/bin/true" ]; }; }
