package flightdeck.spark;

import io.grpc.ManagedChannel;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.netty.handler.ssl.SslContextBuilder;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.net.URI;
import java.nio.file.Files;
import java.nio.file.InvalidPathException;
import java.nio.file.Path;
import java.util.Iterator;
import java.util.Optional;
import java.util.concurrent.TimeUnit;
import javax.net.ssl.SSLException;
import org.apache.arrow.flight.Action;
import org.apache.arrow.flight.CallOption;
import org.apache.arrow.flight.FlightCallHeaders;
import org.apache.arrow.flight.FlightClient;
import org.apache.arrow.flight.FlightGrpcUtils;
import org.apache.arrow.flight.FlightRuntimeException;
import org.apache.arrow.flight.FlightStatusCode;
import org.apache.arrow.flight.HeaderCallOption;
import org.apache.arrow.flight.Result;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.spark.sql.util.ArrowUtils;

/**
 * A connection to one flightdeck server: its location (as {@link
 * ServerNames} reads a name), a Flight client, and the bearer token sent
 * with every call ({@code token} option, else {@code FLIGHTDECK_TOKEN}); over
 * TLS, trusting the certificate authority {@code FLIGHTDECK_TLS_ROOT_CERTS}
 * names (else the JVM's trust store).
 */
final class Server implements AutoCloseable {
  /** The location, {@code grpc://HOST:PORT} or {@code grpc+tls://HOST:PORT}. */
  final String location;

  final FlightClient client;
  final CallOption[] options;
  /** An allocator this connection made for itself (see {@link #open}); else null. */
  private final BufferAllocator own;

  private Server(String location, FlightClient client, CallOption[] options, BufferAllocator own) {
    this.location = location;
    this.client = client;
    this.options = options;
    this.own = own;
  }

  /**
   * A connection for actions and metadata calls (describe, drop, seal,
   * schema, plan) with a small allocator of its own, freed on close.
   */
  static Server open(String name, String token) {
    BufferAllocator own = ArrowUtils.rootAllocator().newChildAllocator("flightdeck " + name, 0, 16 << 20);
    try {
      return connect(name, token, own, own);
    } catch (RuntimeException e) {
      own.close();
      throw e;
    }
  }

  /** Connects (lazily: the first call connects) to the server {@code name} names. */
  static Server connect(String name, String token, BufferAllocator allocator) {
    return connect(name, token, allocator, null);
  }

  private static Server connect(
      String name, String token, BufferAllocator allocator, BufferAllocator own) {
    String location = ServerNames.normalize(name);
    if (location.startsWith("grpc+unix://")) {
      // gRPC-Java's Netty transport has no Unix sockets in this jar.
      throw new IllegalArgumentException(
          "'" + name + "' names the Unix socket " + location + "; the JVM connector reaches "
              + "flightdeck over TCP: give the server's grpc://HOST:PORT as the uri option "
              + "(FLIGHTDECK_URI may name the socket for Python and Rust clients only)");
    }
    FlightClient client = FlightGrpcUtils.createFlightClient(allocator, channel(location));
    String bearer = token != null && !token.isEmpty() ? token : System.getenv("FLIGHTDECK_TOKEN");
    CallOption[] options = new CallOption[0];
    if (bearer != null && !bearer.isEmpty()) {
      FlightCallHeaders headers = new FlightCallHeaders();
      headers.insert("authorization", "Bearer " + bearer);
      options = new CallOption[] {new HeaderCallOption(headers)};
    }
    return new Server(location, client, options, own);
  }

  /** The variable naming the PEM file of the certificate authority TLS servers are trusted by. */
  static final String ROOTS_VARIABLE = "FLIGHTDECK_TLS_ROOT_CERTS";

  /**
   * HTTP/2 pings on every connection, and how long an answer may take: a
   * server that stops answering (hung, or its node cut off) fails the calls
   * waiting on it, and so the task, instead of holding them forever. As the
   * Python client pings.
   */
  static final long KEEPALIVE_SECONDS = 10;

  static final long KEEPALIVE_TIMEOUT_SECONDS = 10;

  /**
   * The gRPC channel to {@code location}, as Flight's own client builder
   * makes one (no limit on message size; over TLS, the roots {@link
   * #trustRoots} gives), with keepalive pings.
   */
  private static ManagedChannel channel(String location) {
    URI uri = URI.create(location);
    NettyChannelBuilder builder =
        NettyChannelBuilder.forAddress(uri.getHost(), uri.getPort())
            .maxInboundMessageSize(Integer.MAX_VALUE)
            .maxInboundMetadataSize(Integer.MAX_VALUE)
            .keepAliveTime(KEEPALIVE_SECONDS, TimeUnit.SECONDS)
            .keepAliveTimeout(KEEPALIVE_TIMEOUT_SECONDS, TimeUnit.SECONDS)
            .keepAliveWithoutCalls(true);
    if (location.startsWith("grpc+tls://")) {
      try {
        SslContextBuilder tls = GrpcSslContexts.forClient();
        byte[] roots = trustRoots();
        if (roots != null) {
          tls.trustManager(new ByteArrayInputStream(roots));
        }
        builder.useTransportSecurity().sslContext(tls.build());
      } catch (SSLException e) {
        throw new IllegalArgumentException("cannot set up TLS to " + location + ": " + e, e);
      }
    } else {
      builder.usePlaintext();
    }
    return builder.build();
  }

  /**
   * The certificates in the PEM file {@code FLIGHTDECK_TLS_ROOT_CERTS}
   * names, which a TLS connection trusts, as the Python and Rust clients do
   * (set it on the driver and every executor, {@code
   * spark.executorEnv.*}); without it (null), the JVM's own trust store.
   */
  private static byte[] trustRoots() {
    String roots = System.getenv(ROOTS_VARIABLE);
    if (roots == null || roots.isEmpty()) {
      return null;
    }
    try {
      return Files.readAllBytes(Path.of(roots));
    } catch (IOException | InvalidPathException e) {
      throw new IllegalArgumentException(ROOTS_VARIABLE + " names '" + roots + "', which cannot "
          + "be read (" + e + "): set it to the PEM file of the servers' certificate authority, "
          + "on the driver and on every executor (spark.executorEnv." + ROOTS_VARIABLE + ")");
    }
  }

  /** Runs action {@code kind} and returns its one result's body. */
  byte[] action(String kind, byte[] body) {
    try {
      Iterator<Result> results = client.doAction(new Action(kind, body), options);
      if (!results.hasNext()) {
        throw new FlightDeckException(
            "INTERNAL", "action '" + kind + "' on " + location + " returned no result");
      }
      byte[] out = results.next().getBody();
      while (results.hasNext()) {
        results.next();
      }
      return out;
    } catch (FlightRuntimeException e) {
      throw FlightDeckException.of(e, location);
    }
  }

  /** The dataset as {@code describe} shows it; empty when there is none. */
  Optional<Wire.DatasetInfo> describe(String dataset) {
    try {
      return Optional.of(Wire.datasetInfo(action("describe", Wire.datasetName(dataset))));
    } catch (FlightDeckException e) {
      if (e.code.equals(FlightStatusCode.NOT_FOUND.name())) {
        return Optional.empty();
      }
      throw e;
    }
  }

  /** The description of a dataset to read, refusing one missing or unsealed. */
  Wire.DatasetInfo sealed(String dataset) {
    Wire.DatasetInfo info = describe(dataset).orElseThrow(() -> new FlightDeckException(
        "NOT_FOUND", "dataset '" + dataset + "' does not exist on " + location
            + "; write it first (df.write.format(\"flightdeck\"))"));
    if (info.sealing()) {
      throw new FlightDeckException("FAILED_PRECONDITION", unfinishedSeal(dataset, location));
    }
    if (!info.sealed()) {
      throw new FlightDeckException("FAILED_PRECONDITION", "dataset '" + dataset
          + "' is still being written; read it once its write has been sealed");
    }
    return info;
  }

  /** What a dataset whose seal across servers did not finish on {@code location} needs. */
  static String unfinishedSeal(String dataset, String location) {
    return "dataset '" + dataset + "' on " + location + " is being sealed across servers and "
        + "its seal did not finish there (the job that wrote it failed while sealing, or is "
        + "sealing it now); write it again with mode(\"overwrite\"), or drop it: flightdeck drop "
        + dataset + " --server " + location;
  }

  /**
   * Drops the dataset; true if there was one. {@code abortWrite} (may be
   * empty) names a failed write whose attempts the server refuses from now
   * on; with {@code staged}, only what that write staged goes; a dataset
   * that write {@code keepWrite} (may be empty) swapped in stays, refused
   * with {@code FAILED_PRECONDITION}.
   */
  boolean drop(String dataset, String abortWrite, boolean staged, String keepWrite) {
    try {
      action("drop", Wire.drop(dataset, abortWrite, staged, keepWrite));
      return true;
    } catch (FlightDeckException e) {
      if (e.code.equals(FlightStatusCode.NOT_FOUND.name())) {
        return false;
      }
      throw e;
    }
  }

  @Override
  public void close() {
    try {
      client.close();
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    } finally {
      if (own != null) {
        own.close();
      }
    }
  }
}
