package flightdeck.spark;

import java.util.Map;
import org.apache.arrow.flight.FlightDescriptor;
import org.apache.arrow.flight.FlightRuntimeException;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.ArrowUtils;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * {@code format("flightdeck")}: writes a DataFrame into a flightdeck
 * dataset exactly once per partition, and reads a sealed dataset back.
 *
 * <pre>
 * df.write.format("flightdeck")
 *   .option("uri", "local")            // each executor's own node server
 *   .option("dataset", "clicks")
 *   .mode("overwrite")                  // or "append": a new dataset only
 *   .save()
 * spark.read.format("flightdeck").option("uri", "node7").option("dataset", "clicks").load()
 * </pre>
 *
 * See {@link Options} for every option and {@link FlightDeckWrite} for the
 * commit rule.
 */
public final class FlightDeckDataSource implements TableProvider, DataSourceRegister {
  /** For Spark's service loader. */
  public FlightDeckDataSource() {}

  @Override
  public String shortName() {
    return "flightdeck";
  }

  /** A read without a given schema: the dataset's own, from its server. */
  @Override
  public StructType inferSchema(CaseInsensitiveStringMap map) {
    Options options = Options.of(map);
    try (Server server = Server.open(options.uri(), options.token())) {
      server.sealed(options.dataset());
      try {
        return ArrowUtils.fromArrowSchema(
            server.client
                .getSchema(FlightDescriptor.path(options.dataset()), server.options)
                .getSchema());
      } catch (FlightRuntimeException e) {
        throw FlightDeckException.of(e, server.location);
      }
    }
  }

  @Override
  public Table getTable(
      StructType schema, Transform[] partitioning, Map<String, String> properties) {
    return new FlightDeckTable(Options.of(properties), schema);
  }

  /** Writes take the DataFrame's schema. */
  @Override
  public boolean supportsExternalMetadata() {
    return true;
  }
}
