# want: services.nixcage.store.rootThreshold = 2 but store.rootKeys lists 1 key(s)
{ services.nixcage.store = { channel = "stable"; keys = [ "/etc/nixcage/release.pub" ]; rootKeys = [ "/etc/nixcage/root-1.pub" ]; rootThreshold = 2; }; }
