package flightdeck.spark;

import java.net.InetAddress;
import java.net.UnknownHostException;

/**
 * How a server is named: the same rules as the Rust and Python clients
 * (one table of cases, {@code tests/server_names.tsv}, tests all three).
 * {@code local} is this node's server ({@code FLIGHTDECK_URI} where it is
 * set, else 127.0.0.1); {@code local:PORT}, {@code HOST}, {@code HOST:PORT},
 * IPv6 literals, and {@code grpc://}, {@code grpc+tcp://}, {@code http://},
 * {@code grpc+tls://} or {@code https://} before any of those; port 50051
 * wherever none is given; {@code grpc+unix://} or {@code unix://} before
 * the absolute path of a server's {@code --unix-socket}.
 */
public final class ServerNames {
  /** The port a name without one means. */
  public static final int DEFAULT_PORT = 50051;

  private ServerNames() {}

  /**
   * The location {@code name} names, {@code grpc://HOST:PORT},
   * {@code grpc+tls://HOST:PORT} or {@code grpc+unix:///PATH}; {@code local} is read from
   * {@code FLIGHTDECK_URI}.
   */
  public static String normalize(String name) {
    return normalize(name, System.getenv("FLIGHTDECK_URI"));
  }

  /**
   * The host of a member's location ({@code grpc://HOST:PORT}, IPv6 without
   * brackets), for Spark to run the task reading its rows there; "" for a
   * Unix socket or a name that is not a location.
   */
  public static String host(String location) {
    try {
      String at = normalize(location, "");
      if (at.startsWith("grpc+unix://")) {
        return "";
      }
      String host = java.net.URI.create(at).getHost();
      if (host == null) {
        return "";
      }
      return host.startsWith("[") && host.endsWith("]")
          ? host.substring(1, host.length() - 1)
          : host;
    } catch (IllegalArgumentException e) {
      return "";
    }
  }

  /** {@link #normalize(String)} with {@code local} given (null: unset). */
  public static String normalize(String name, String local) {
    String n = name == null ? "" : name.strip();
    if (n.equals("local")) {
      String target = local == null ? "" : local.strip();
      if (target.isEmpty() || target.equals("local") || target.startsWith("local:")) {
        return "grpc://127.0.0.1:" + DEFAULT_PORT;
      }
      return normalize(target, "");
    }
    if (n.startsWith("local:")) {
      int port = port(n.substring("local:".length()));
      if (port < 0) {
        throw bad(name);
      }
      return "grpc://127.0.0.1:" + port;
    }
    String scheme = "grpc";
    String rest = n;
    int sep = n.indexOf("://");
    if (sep >= 0) {
      scheme = n.substring(0, sep);
      rest = n.substring(sep + 3);
    }
    if (scheme.equals("grpc+unix") || scheme.equals("unix")) {
      // A socket's absolute path, nothing that could be read as a host.
      boolean absolute = rest.startsWith("/") && rest.length() > 1 && !rest.endsWith("/");
      if (!absolute || rest.chars().anyMatch(Character::isWhitespace)) {
        throw bad(name);
      }
      return "grpc+unix://" + rest;
    }
    switch (scheme) {
      case "grpc", "grpc+tcp", "http" -> scheme = "grpc";
      case "grpc+tls", "https" -> scheme = "grpc+tls";
      default -> throw bad(name);
    }
    String authority = rest.endsWith("/") ? rest.substring(0, rest.length() - 1) : rest;
    String hostPort = splitAuthority(authority);
    if (hostPort == null) {
      throw bad(name);
    }
    return scheme + "://" + hostPort;
  }

  private static IllegalArgumentException bad(String name) {
    return new IllegalArgumentException(
        "'" + name + "' does not name a server: give host[:port], grpc://host[:port], "
            + "grpc+tls://host[:port], grpc+unix:///path or local (the default port is "
            + DEFAULT_PORT + ")");
  }

  /** A port: digits only, 1 to 65535; -1 otherwise. */
  private static int port(String s) {
    if (s.isEmpty() || s.length() > 5 || !s.chars().allMatch(c -> c >= '0' && c <= '9')) {
      return -1;
    }
    int p = Integer.parseInt(s);
    return p > 0 && p < 65536 ? p : -1;
  }

  private static boolean ipv6(String s) {
    if (s.isEmpty() || !s.contains(":")
        || !s.chars().allMatch(c -> Character.digit(c, 16) >= 0 || c == ':' || c == '.' || c == '%')) {
      return false;
    }
    try {
      // A literal: no name lookup happens for it.
      return InetAddress.getByName(s).getAddress().length == 16;
    } catch (UnknownHostException e) {
      return false;
    }
  }

  /** {@code HOST[:PORT]} as {@code host:port} for a URI; null if malformed. */
  private static String splitAuthority(String a) {
    if (a.isEmpty() || a.chars().anyMatch(c -> "/?#@".indexOf(c) >= 0 || Character.isWhitespace(c))) {
      return null;
    }
    if (a.startsWith("[")) {
      int close = a.indexOf(']');
      if (close < 0 || !ipv6(a.substring(1, close))) {
        return null;
      }
      String host = a.substring(0, close + 1);
      String after = a.substring(close + 1);
      if (after.isEmpty()) {
        return host + ":" + DEFAULT_PORT;
      }
      int p = after.startsWith(":") ? port(after.substring(1)) : -1;
      return p < 0 ? null : host + ":" + p;
    }
    if (a.indexOf(':') != a.lastIndexOf(':')) {
      return ipv6(a) ? "[" + a + "]:" + DEFAULT_PORT : null;
    }
    int colon = a.indexOf(':');
    if (colon == 0) {
      return null;
    }
    if (colon < 0) {
      return a + ":" + DEFAULT_PORT;
    }
    int p = port(a.substring(colon + 1));
    return p < 0 ? null : a.substring(0, colon) + ":" + p;
  }
}
